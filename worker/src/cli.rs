//! The `baton-worker` command line.

use std::{io::Write, path::PathBuf, time::Instant};

use anyhow::Context as _;
use burn_tensor::backend::Backend;
use clap::{Args, Parser, Subcommand};

use crate::{
    backend::BackendKind,
    engine::llama::WeightDtype,
    engine::sampler::SamplingParams,
    engine::{chat::ChatMessage, generate::ToolUse, Engine, GenerateParams, Prompt},
};

/// Baton worker.
#[derive(Debug, Parser)]
#[command(name = "baton-worker", version, about)]
pub struct Cli {
    /// What to do.
    #[command(subcommand)]
    pub command: Command,
}

/// Subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Generate a completion locally, without a cluster.
    Generate(GenerateArgs),
    /// Measure prefill and decode speed and peak memory.
    Bench(crate::bench::BenchArgs),
    /// Drive the engine thread in-process at a given load (serving benchmark).
    BenchServe(crate::bench::ServeBenchArgs),
    /// Join a cluster over NATS and serve the model.
    // Boxed: its NATS settings make it much larger than the other variants.
    Serve(Box<crate::serve::ServeArgs>),
    /// Write a Llama GGUF with random weights, for speed measurements at other sizes
    /// (its text is noise; its speed is a real model's of that shape).
    Synth(SynthArgs),
}

/// Shapes `synth` writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum SynthShape {
    /// Llama 3.2 1B's layers and widths (16 layers, hidden 2048, FFN 8192, 32 heads over
    /// 8 KV heads) with a 32k vocabulary, Q4_1: about 0.7 GiB.
    #[value(name = "1b")]
    Llama1b,
    /// The default model's shape, SmolLM2-135M (30 layers, hidden 576, a 49k
    /// vocabulary), Q4_1: about 90 MiB.
    #[value(name = "135m")]
    Smollm2,
    /// 2 layers, hidden 64: what tests use.
    Tiny,
}

/// Arguments of `synth`.
#[derive(Debug, Args)]
pub struct SynthArgs {
    /// The shape.
    #[arg(long, value_enum, default_value = "1b")]
    pub shape: SynthShape,
    /// Where to write the file.
    #[arg(long)]
    pub out: PathBuf,
    /// Seed of the weights.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Format of the matrices (default: the shape's own, Q4_1; f32 for `tiny`).
    #[arg(long = "type", value_enum)]
    pub weight_type: Option<SynthType>,
}

/// Block formats `synth` writes.
#[derive(Debug, Clone, Copy, clap::ValueEnum)]
pub enum SynthType {
    /// GGUF Q4_1 (4-bit values, a scale and a minimum a block).
    #[value(name = "q4-1")]
    Q4_1,
    /// GGUF Q4_0 (4-bit values, a scale a block).
    #[value(name = "q4-0")]
    Q4_0,
    /// GGUF Q8_0 (8-bit values, a scale a block).
    #[value(name = "q8-0")]
    Q8_0,
}

impl From<SynthType> for crate::engine::gguf::GgmlType {
    fn from(ty: SynthType) -> Self {
        match ty {
            SynthType::Q4_1 => Self::Q4_1,
            SynthType::Q4_0 => Self::Q4_0,
            SynthType::Q8_0 => Self::Q8_0,
        }
    }
}

/// Arguments of `generate`.
#[derive(Debug, Args)]
pub struct GenerateArgs {
    /// GGUF model file.
    #[arg(long, env = baton_common::env::MODEL, default_value = "models/SmolLM2-135M-Instruct.Q4_1.gguf")]
    pub model: PathBuf,
    /// Prompt text (the user message with --chat).
    #[arg(long)]
    pub prompt: String,
    /// Render the prompt as a user message through the model's chat template.
    #[arg(long)]
    pub chat: bool,
    /// System message (with --chat).
    #[arg(long, requires = "chat")]
    pub system: Option<String>,
    /// Most tokens to generate.
    #[arg(long, default_value_t = 128)]
    pub max_tokens: usize,
    /// Sampling temperature; 0 is greedy.
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f32,
    /// Nucleus sampling mass.
    #[arg(long, default_value_t = 1.0)]
    pub top_p: f32,
    /// Keep only the k most likely tokens (0: all).
    #[arg(long, default_value_t = 0)]
    pub top_k: usize,
    /// Repetition penalty (1: none).
    #[arg(long, default_value_t = 1.0)]
    pub repetition_penalty: f32,
    /// Seed of the sampler.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Stop strings (repeatable).
    #[arg(long)]
    pub stop: Vec<String>,
    /// Keep only tokens at least this probable relative to the likeliest one.
    #[arg(long, default_value_t = 0.0)]
    pub min_p: f32,
    /// Subtracted once from the logit of each token the output holds (−2..=2).
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    pub presence_penalty: f32,
    /// Subtracted from a token's logit per time the output holds it (−2..=2).
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    pub frequency_penalty: f32,
    /// `ID=BIAS`: added to token ID's logit (repeatable).
    #[arg(long, value_parser = parse_bias, allow_negative_numbers = true)]
    pub logit_bias: Vec<(u32, f32)>,
    /// No end token, stop token or stop string before this many tokens.
    #[arg(long, default_value_t = 0)]
    pub min_tokens: usize,
    /// A token id that ends the output (repeatable).
    #[arg(long)]
    pub stop_token_id: Vec<u32>,
    /// Report each token's log-probability and this many alternatives (with `--json`).
    #[arg(long)]
    pub logprobs: Option<usize>,
    /// Score the prompt: each prompt token's log-probability given those before it,
    /// with this many alternatives (with `--json`); `--max-tokens` may then be 0.
    #[arg(long)]
    pub prompt_logprobs: Option<usize>,
    /// Functions the model may call (with --chat): OpenAI's `tools` array as JSON text.
    #[arg(long, requires = "chat")]
    pub tools: Option<String>,
    /// `auto`, `required` or a function's name (with --tools).
    #[arg(long, requires = "tools", default_value = "auto")]
    pub tool_choice: String,
    /// At most one tool call (with --tools).
    #[arg(long, requires = "tools")]
    pub no_parallel_tool_calls: bool,
    /// Print one JSON object (text, ids, finish, logprobs, tool calls) instead of the text.
    #[arg(long)]
    pub json: bool,
    /// Constrain the output to this JSON schema (its JSON text).
    #[arg(long, conflicts_with_all = ["regex", "lark"])]
    pub json_schema: Option<String>,
    /// Constrain the output to this regular expression.
    #[arg(long, conflicts_with = "lark")]
    pub regex: Option<String>,
    /// Constrain the output to this grammar (llguidance's Lark dialect).
    #[arg(long)]
    pub lark: Option<String>,
    /// Weight format kept in memory: native-i16 (the file's blocks, CPU, with 16-bit
    /// integer activations for generated tokens), native-i8 (the same, prompts on 8-bit
    /// activations: faster, coarser), native (the same blocks, all f32 activations), f16
    /// or f32.
    #[arg(long, default_value = "native-i16")]
    pub dtype: WeightDtype,
    /// How the host KV store keeps keys and values: f16 or f32.
    #[arg(long, default_value_t = crate::engine::llama::KvDtype::default())]
    pub kv_dtype: crate::engine::llama::KvDtype,
    /// Backend: cpu, cuda or wgpu (a device backend keeps the weights as f16 or f32
    /// tensors: `native*` is served as f16).
    #[arg(long, env = baton_common::env::BACKEND, default_value = "cpu")]
    pub backend: BackendKind,
    /// Print token ids and timings to stderr.
    #[arg(long)]
    pub verbose: bool,
}

/// `ID=BIAS`.
fn parse_bias(s: &str) -> Result<(u32, f32), String> {
    let (id, bias) = s
        .split_once('=')
        .ok_or_else(|| format!("{s:?} is not ID=BIAS"))?;
    Ok((
        id.trim()
            .parse()
            .map_err(|e| format!("token id {id:?}: {e}"))?,
        bias.trim()
            .parse()
            .map_err(|e| format!("bias {bias:?}: {e}"))?,
    ))
}

impl GenerateArgs {
    /// The tools the options offer, checked, with the array as given.
    pub fn tools(&self) -> anyhow::Result<Option<(serde_json::Value, ToolUse)>> {
        use baton_common::protocol::ToolChoice;
        let Some(text) = &self.tools else {
            return Ok(None);
        };
        let array: serde_json::Value = serde_json::from_str(text).context("--tools is not JSON")?;
        let functions = baton_common::tools::functions(&array)?;
        let choice = match self.tool_choice.as_str() {
            "auto" => ToolChoice::Auto,
            "required" => ToolChoice::Required,
            name => ToolChoice::Function(name.to_string()),
        };
        let tools = ToolUse {
            functions,
            choice,
            parallel: !self.no_parallel_tool_calls,
        };
        Ok(Some((array, tools)))
    }

    /// The grammar the options ask for.
    pub fn grammar(&self) -> Option<baton_common::protocol::Grammar> {
        use baton_common::protocol::Grammar;
        self.json_schema
            .clone()
            .map(Grammar::JsonSchema)
            .or_else(|| self.regex.clone().map(Grammar::Regex))
            .or_else(|| self.lark.clone().map(Grammar::Lark))
    }
}

/// Runs the command line.
pub fn run(cli: Cli) -> anyhow::Result<()> {
    match cli.command {
        Command::Generate(mut args) => {
            args.dtype = crate::backend::serving_weights(args.backend, args.dtype);
            crate::with_backend!(args.backend, B => generate::<B>(&args, &Default::default()))
        }
        Command::Bench(mut args) => {
            args.dtype = crate::backend::serving_weights(args.backend, args.dtype);
            crate::with_backend!(args.backend, B => crate::bench::run::<B>(&args, &Default::default()))
        }
        Command::Serve(args) => crate::serve::run(*args),
        Command::BenchServe(args) => crate::bench::run_serve(&args),
        Command::Synth(args) => synth(&args),
    }
}

fn synth(args: &SynthArgs) -> anyhow::Result<()> {
    use crate::engine::llama::synthetic::{write_synthetic_llama, SyntheticSpec};
    let mut spec = match args.shape {
        SynthShape::Llama1b => SyntheticSpec::llama_1b(args.seed),
        SynthShape::Smollm2 => SyntheticSpec::smollm2_135m(args.seed),
        SynthShape::Tiny => SyntheticSpec::tiny(args.seed),
    };
    if let Some(ty) = args.weight_type {
        spec.weight_type = ty.into();
    }
    write_synthetic_llama(&args.out, &spec)
        .with_context(|| format!("writing {}", args.out.display()))?;
    let bytes = std::fs::metadata(&args.out)?.len();
    println!(
        "wrote {} ({:?} {:?}, {} layers, hidden {}, {:.1} MiB)",
        args.out.display(),
        args.shape,
        spec.weight_type,
        spec.config.n_layers,
        spec.config.hidden,
        bytes as f64 / (1 << 20) as f64
    );
    Ok(())
}

fn generate<B: Backend>(args: &GenerateArgs, device: &B::Device) -> anyhow::Result<()> {
    let t0 = Instant::now();
    let mut engine = Engine::<B>::load(&args.model, args.dtype, device)?;
    engine.set_kv_dtype(args.kv_dtype);
    let load = t0.elapsed();
    let prompt = if args.chat {
        let mut messages = Vec::new();
        if let Some(system) = &args.system {
            messages.push(ChatMessage::new("system", system.clone()));
        }
        messages.push(ChatMessage::new("user", args.prompt.clone()));
        Prompt::Chat(messages)
    } else {
        Prompt::Text(args.prompt.clone())
    };
    let tools = args.tools()?;
    let ids = match (&prompt, &tools) {
        (Prompt::Chat(messages), Some((array, _))) => {
            engine.encode_chat_with(messages, Some(array), true)?
        }
        _ => engine.encode_prompt(&prompt)?,
    };
    let params = GenerateParams {
        max_tokens: args.max_tokens,
        sampling: SamplingParams {
            temperature: args.temperature,
            top_k: args.top_k,
            top_p: args.top_p,
            repetition_penalty: args.repetition_penalty,
            min_p: args.min_p,
            presence_penalty: args.presence_penalty,
            frequency_penalty: args.frequency_penalty,
            logit_bias: args.logit_bias.clone(),
            seed: args.seed,
        },
        stop: args.stop.clone(),
        ignore_eos: false,
        grammar: args.grammar(),
        min_tokens: args.min_tokens,
        stop_token_ids: args.stop_token_id.clone(),
        logprobs: args.logprobs,
        prompt_logprobs: args.prompt_logprobs,
        tools: tools.map(|(_, t)| t),
    };
    let n_prompt = ids.len();
    let t1 = Instant::now();
    let mut first = None;
    let mut stdout = std::io::stdout().lock();
    let mut logprobs = Vec::new();
    let completion = engine.generate(ids, params, &mut |ev| {
        if first.is_none() {
            first = Some(t1.elapsed());
        }
        if args.json {
            if let Some(l) = &ev.logprobs {
                logprobs.push(serde_json::json!({"id": ev.id, "logprob": l.logprob, "top": l.top}));
            }
        } else {
            let _ = stdout.write_all(ev.text.as_bytes());
            let _ = stdout.flush();
        }
    })?;
    if args.json {
        let out = serde_json::json!({
            "text": completion.text,
            "prompt_ids": completion.prompt_ids,
            "ids": completion.ids,
            "finish": completion.finish.openai(),
            "tool_calls": completion
                .tool_calls
                .iter()
                .map(|c| serde_json::json!({"name": c.name, "arguments": c.arguments}))
                .collect::<Vec<_>>(),
            "logprobs": logprobs,
            "prompt_logprobs": completion
                .prompt_logprobs
                .iter()
                .map(|l| serde_json::json!({"logprob": l.logprob, "top": l.top}))
                .collect::<Vec<_>>(),
        });
        let _ = write!(stdout, "{out}");
    }
    let _ = writeln!(stdout);
    let total = t1.elapsed();
    if args.verbose {
        let first = first.unwrap_or(total);
        let decode = total.saturating_sub(first).as_secs_f64();
        let n = completion.ids.len();
        eprintln!("prompt ids: {:?}", completion.prompt_ids);
        eprintln!("output ids: {:?}", completion.ids);
        eprintln!(
            "load {:.2}s, prompt {} tokens, first token {:.1} ms, {} tokens, decode {:.1} tok/s, finish {:?}",
            load.as_secs_f64(),
            n_prompt,
            first.as_secs_f64() * 1e3,
            n,
            if decode > 0.0 { (n.saturating_sub(1)) as f64 / decode } else { 0.0 },
            completion.finish
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn synth_writes_a_model_that_loads_and_generates() {
        for ty in [None, Some(SynthType::Q8_0), Some(SynthType::Q4_0)] {
            synth_loads_and_generates(ty);
        }
    }

    fn synth_loads_and_generates(ty: Option<SynthType>) {
        let dir = tempfile::TempDir::new().expect("tempdir");
        let out = dir.path().join("tiny.gguf");
        synth(&SynthArgs {
            shape: SynthShape::Tiny,
            out: out.clone(),
            seed: 3,
            weight_type: ty,
        })
        .expect("synth");
        let gguf = crate::engine::gguf::GgufFile::open(&out).expect("opens");
        let want = ty.map_or(crate::engine::gguf::GgmlType::F32, Into::into);
        let info = gguf.tensor("blk.0.ffn_up.weight").expect("a matrix");
        assert_eq!(info.ggml_type, want);
        let engine = Engine::<crate::backend::CpuBackend>::load(
            &out,
            WeightDtype::default(),
            &Default::default(),
        )
        .expect("the written model loads");
        let ids = engine
            .encode_prompt(&Prompt::Text("hello".into()))
            .expect("encode");
        let params = GenerateParams {
            max_tokens: 4,
            ignore_eos: true,
            ..Default::default()
        };
        let completion = engine.generate(ids, params, &mut |_| {}).expect("generate");
        assert_eq!(completion.ids.len(), 4);
    }
}
