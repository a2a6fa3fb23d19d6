//! `baton-worker bench`: prefill and decode speed and peak memory of the engine.
//!
//! Timing lives here, in a benchmark the user runs, never in tests. Output lines are
//! stable and machine-readable (`baton pp128 dtype=f32 threads=2 tok_s=…`), in the same
//! shape as `scripts/llamacpp-bench` prints, so `scripts/bench-engine` can put them side
//! by side.

use std::{path::PathBuf, time::Instant};

use burn_tensor::backend::Backend;
use clap::Args;

use crate::engine::{
    llama::{SeqInput, WeightDtype},
    Engine, GenerateParams,
};

/// Arguments of `bench`.
#[derive(Debug, Args)]
pub struct BenchArgs {
    /// GGUF model file.
    #[arg(long, env = baton_common::env::MODEL, default_value = "models/SmolLM2-135M-Instruct.Q4_1.gguf")]
    pub model: PathBuf,
    /// Weight format kept in memory: native-i16, native-i8, native, f16 or f32.
    #[arg(long, default_value = "native-i16")]
    pub dtype: WeightDtype,
    /// How the host KV store keeps keys and values: f16 or f32.
    #[arg(long, default_value_t = crate::engine::llama::KvDtype::default())]
    pub kv_dtype: crate::engine::llama::KvDtype,
    /// Backend: cpu, cuda or wgpu (a device backend serves `native*` as f16 tensors).
    #[arg(long, default_value = "cpu")]
    pub backend: crate::backend::BackendKind,
    /// Prompt length of the prefill test.
    #[arg(long, default_value_t = 128)]
    pub prompt_tokens: usize,
    /// Tokens generated in the decode test.
    #[arg(long, default_value_t = 64)]
    pub gen_tokens: usize,
    /// Repetitions; the best is reported (the machine is shared and noisy).
    #[arg(long, default_value_t = 3)]
    pub reps: usize,
    /// Batched decode: for each count N in this comma-separated list, N sequences
    /// decode together (one forward pass a step) and the aggregate tokens/s is
    /// reported (`baton tg64 batch=N …`). Empty: single-stream only.
    #[arg(long, value_delimiter = ',')]
    pub batch: Vec<usize>,
    /// Prompt length of the first batched sequence (the others' grow by one each, up
    /// to `--prompt-tokens`): longer prompts weigh attention, which reads every cached
    /// key and value each step.
    #[arg(long, default_value_t = 16)]
    pub batch_prompt: usize,
    /// Skip the prefill test.
    #[arg(long)]
    pub no_prefill: bool,
    /// Time to first token of chat requests that share a system prompt of about this
    /// many tokens, with the prefix cache and without it, alternating (`baton ttft …`
    /// lines, median of `--reps` requests each). 0: skip.
    #[arg(long, default_value_t = 0)]
    pub shared_prefix: usize,
    /// Prefix cache budget of the shared-prefix test, in MiB.
    #[arg(long, default_value_t = 256)]
    pub prefix_cache_mib: usize,
    /// Sampling temperature of the decode runs (0: greedy; above, every token is drawn
    /// over the whole vocabulary, as a request at that temperature would be).
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f32,
    /// A prompt of this many tokens joins 15 generating sequences, with each step
    /// budget of `--step-tokens` in turn (`--reps` times, alternating): the longest step
    /// the generating sequences wait through and the joining prompt's time to its first
    /// token (`baton join …` lines, medians). 0: skip.
    #[arg(long, default_value_t = 0)]
    pub join_prompt: usize,
    /// Step budgets of the `--join-prompt` test (0: no limit).
    #[arg(long, value_delimiter = ',', default_value = "0,256")]
    pub step_tokens: Vec<usize>,
    /// Only the matrix-product kernels, on one thread: a 1536 × 576 matrix (the
    /// model's gate and up shape) of random weights in Q4_1 and Q8_0, taken in slices of
    /// 96 rows as the forward pass takes them, against generated-token rows (16-bit
    /// integer inputs) and prompt rows (f32 inputs, the panel product)
    /// (`baton kernel …` lines, multiply-adds a second, best of `--reps`).
    #[arg(long)]
    pub kernels: bool,
    /// Also run each `--batch` size with every sequence held to this JSON schema (its
    /// text), in the same run, alternating with the free runs: `baton tg… batch=N
    /// json_schema …` lines beside the free ones. Choose a schema that cannot end
    /// within `--gen-tokens` (an array with a large `minItems`): tokens per second count
    /// the tokens made, and a sequence whose grammar ends leaves the batch.
    #[arg(long)]
    pub json_schema: Option<String>,
}

/// `--kernels`: single-thread speed of the products of generated-token and prompt rows.
fn kernel_speeds(reps: usize) -> anyhow::Result<()> {
    use crate::engine::{
        cpu::qmatrix::{Prepared, QMatrix},
        gguf::{writer::quantize, GgmlType},
    };
    let (rows, cols, slice) = (1536, 576, 96);
    // Deterministic values in [-1, 1).
    let values = |n: usize, seed: u64| -> Vec<f32> {
        (0..n as u64)
            .map(|i| {
                let h = (i ^ seed).wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 40;
                (h % 2000) as f32 / 1000.0 - 1.0
            })
            .collect()
    };
    let w = values(rows * cols, 1);
    for ty in [GgmlType::Q4_1, GgmlType::Q8_0] {
        let q = QMatrix::from_gguf(ty, rows, cols, &quantize(ty, &w)?)
            .ok_or_else(|| anyhow::anyhow!("{ty:?} does not repack"))?
            .with_int_inputs(true);
        for (generated, n) in [(true, 1), (true, 4), (true, 16), (false, 16), (false, 128)] {
            let x = values(n * cols, 7);
            let mut prep = Prepared::default();
            q.prepare(&x, &vec![generated; n], &mut prep);
            let (mut tile, mut out) = (Vec::new(), vec![0.0f32; slice * n]);
            let macs = (rows * cols * n) as f64;
            let passes = (3e8 / macs).ceil() as usize;
            let mut best = f64::MAX;
            for _ in 0..reps.max(1) {
                let t = Instant::now();
                for _ in 0..passes {
                    for r0 in (0..rows).step_by(slice) {
                        q.product_rows(&x, n, &prep, r0, r0 + slice, &mut tile, &mut out);
                    }
                }
                best = best.min(t.elapsed().as_secs_f64());
            }
            println!(
                "baton kernel {ty:?} rows={} n={n} gmac_s={:.1}",
                if generated { "generated" } else { "prompt" },
                macs * passes as f64 / best / 1e9
            );
        }
    }
    Ok(())
}

/// Sampling at `temperature` (greedy at 0), seeded.
fn sampling(temperature: f32) -> crate::engine::sampler::SamplingParams {
    crate::engine::sampler::SamplingParams {
        temperature,
        seed: 7,
        ..Default::default()
    }
}

/// Peak resident set size of this process, in bytes (Linux `VmHWM`).
pub fn peak_rss_bytes() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// Runs the benchmark and prints its lines.
pub fn run<B: Backend>(args: &BenchArgs, device: &B::Device) -> anyhow::Result<()> {
    if args.kernels {
        return kernel_speeds(args.reps);
    }
    let threads = rayon::current_num_threads();
    let mut tag = format!(
        "dtype={} kv={} threads={threads}",
        args.dtype, args.kv_dtype
    );
    if args.backend.is_device() {
        tag.push_str(&format!(" backend={}", args.backend));
    }
    if args.temperature > 0.0 {
        tag.push_str(&format!(" temperature={}", args.temperature));
    }
    let t0 = Instant::now();
    let mut engine = Engine::<B>::load(&args.model, args.dtype, device)?;
    engine.set_kv_dtype(args.kv_dtype);
    println!("baton load {tag} seconds={:.2}", t0.elapsed().as_secs_f64());
    let model = engine.model();
    println!(
        "baton weights {tag} mib={:.1}",
        model.decode_weight_bytes() as f64 / (1024.0 * 1024.0)
    );
    // A real-text prompt, repeated to length.
    let text = "The quick brown fox jumps over the lazy dog. In 1969, the first humans \
                walked on the Moon, and the world watched on television. ";
    let seed = engine.tokenizer().encode(text, false)?;
    let prompt: Vec<u32> = seed
        .iter()
        .copied()
        .cycle()
        .take(args.prompt_tokens)
        .collect();

    let mut best_pp = f64::MAX;
    for _ in 0..if args.no_prefill {
        0
    } else {
        args.reps.max(1) + 1
    } {
        let mut cache = model.new_cache();
        let t = Instant::now();
        let logits = model.forward(&mut [SeqInput {
            tokens: &prompt,
            cache: &mut cache,
        }])?;
        let _ = crate::engine::llama::Llama::<B>::logits_to_host(logits);
        best_pp = best_pp.min(t.elapsed().as_secs_f64());
    }
    if !args.no_prefill {
        println!(
            "baton pp{} {tag} tok_s={:.1}",
            args.prompt_tokens,
            args.prompt_tokens as f64 / best_pp
        );
    }

    let mut best_tg = f64::MAX;
    for _ in 0..args.reps.max(1) {
        let params = GenerateParams {
            max_tokens: args.gen_tokens + 1,
            ignore_eos: true,
            sampling: sampling(args.temperature),
            ..Default::default()
        };
        let mut seq = engine.start(prompt[..16.min(prompt.len())].to_vec(), params)?;
        // The first step is the prompt's prefill; time the steps after it.
        engine.step(&mut [&mut seq])?;
        let t = Instant::now();
        for _ in 0..args.gen_tokens {
            engine.step(&mut [&mut seq])?;
        }
        best_tg = best_tg.min(t.elapsed().as_secs_f64());
    }
    println!(
        "baton tg{} {tag} tok_s={:.1}",
        args.gen_tokens,
        args.gen_tokens as f64 / best_tg
    );
    let grammars: Vec<Option<baton_common::protocol::Grammar>> = std::iter::once(None)
        .chain(
            args.json_schema
                .clone()
                .map(|s| Some(baton_common::protocol::Grammar::JsonSchema(s))),
        )
        .collect();
    for &n in &args.batch {
        let n = n.max(1);
        let mut best = vec![0.0f64; grammars.len()];
        for _ in 0..args.reps.max(1) {
            for (grammar, best) in grammars.iter().zip(&mut best) {
                let params = GenerateParams {
                    max_tokens: args.gen_tokens + 1,
                    ignore_eos: true,
                    sampling: sampling(args.temperature),
                    grammar: grammar.clone(),
                    ..Default::default()
                };
                // Sequences with prompts of different lengths (16, 17, … by default), as
                // a server would hold: their caches and positions differ.
                let mut seqs = (0..n)
                    .map(|i| {
                        let len = (args.batch_prompt + i).min(prompt.len()).max(1);
                        engine.start(prompt[..len].to_vec(), params.clone())
                    })
                    .collect::<Result<Vec<_>, _>>()?;
                let mut refs: Vec<_> = seqs.iter_mut().collect();
                // The first step prefills every prompt in one pass; time the steps after.
                engine.step(&mut refs)?;
                let made = |refs: &[&mut crate::engine::Sequence<B>]| -> usize {
                    refs.iter().map(|s| s.generated().len()).sum()
                };
                let before = made(&refs);
                let t = Instant::now();
                for _ in 0..args.gen_tokens {
                    engine.step(&mut refs)?;
                }
                let rate = (made(&refs) - before) as f64 / t.elapsed().as_secs_f64();
                *best = best.max(rate);
            }
        }
        for (grammar, best) in grammars.iter().zip(&best) {
            println!(
                "baton tg{} batch={n}{} {tag} tok_s={best:.1}",
                args.gen_tokens,
                if grammar.is_some() {
                    " json_schema"
                } else {
                    ""
                },
            );
        }
    }
    if args.shared_prefix > 0 {
        shared_prefix_ttft(&engine, args, &tag)?;
    }
    if args.join_prompt > 0 {
        let long: Vec<u32> = seed
            .iter()
            .copied()
            .cycle()
            .take(args.join_prompt)
            .collect();
        join_long_prompt(&engine, &prompt, &long, args, &tag)?;
    }
    if let Some(rss) = peak_rss_bytes() {
        println!(
            "baton peak_rss {tag} mib={:.0}",
            rss as f64 / (1024.0 * 1024.0)
        );
    }
    Ok(())
}

/// A prompt of `long` tokens joins 15 generating sequences under each step budget of
/// `args.step_tokens`: the longest step while it prefills (what every generating stream
/// waits for its next token) and its time to first token, medians of `args.reps`.
fn join_long_prompt<B: Backend>(
    engine: &Engine<B>,
    short: &[u32],
    long: &[u32],
    args: &BenchArgs,
    tag: &str,
) -> anyhow::Result<()> {
    let params = GenerateParams {
        max_tokens: 1 << 16,
        ignore_eos: true,
        sampling: sampling(args.temperature),
        ..Default::default()
    };
    let mut results: Vec<(Vec<f64>, Vec<f64>)> = vec![Default::default(); args.step_tokens.len()];
    for _ in 0..args.reps.max(1) {
        for (budget, (longest, ttft)) in args.step_tokens.iter().zip(&mut results) {
            engine.set_step_tokens(*budget);
            let mut seqs = (0..15)
                .map(|i| engine.start(short[..(16 + i).min(short.len())].to_vec(), params.clone()))
                .collect::<Result<Vec<_>, _>>()?;
            for _ in 0..2 {
                let mut refs: Vec<_> = seqs.iter_mut().collect();
                engine.step(&mut refs)?;
            }
            seqs.push(engine.start(long.to_vec(), params.clone())?);
            let (start, mut worst) = (Instant::now(), 0.0f64);
            while seqs[15].generated().is_empty() {
                let t = Instant::now();
                let mut refs: Vec<_> = seqs.iter_mut().collect();
                engine.step(&mut refs)?;
                worst = worst.max(t.elapsed().as_secs_f64());
            }
            ttft.push(start.elapsed().as_secs_f64() * 1e3);
            longest.push(worst * 1e3);
        }
    }
    engine.set_step_tokens(0);
    let median = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    for (budget, (longest, ttft)) in args.step_tokens.iter().zip(&mut results) {
        println!(
            "baton join prompt={} step_tokens={budget} {tag} longest_step_ms={:.1} ttft_ms={:.1}",
            long.len(),
            median(longest),
            median(ttft)
        );
    }
    Ok(())
}

/// A system prompt of at least `tokens` tokens, from real text.
pub fn system_prompt<B: Backend>(engine: &Engine<B>, tokens: usize) -> anyhow::Result<String> {
    let sentences = [
        "You are a careful assistant for a shipping company.",
        "Answer in plain English, in short paragraphs, and say when you are unsure.",
        "Never invent tracking numbers, prices or delivery dates.",
        "Customers may write about parcels, pallets, containers, customs forms and refunds.",
        "Ask for the order number before discussing an order.",
        "Be polite, and keep every answer under two hundred words.",
    ];
    let mut text = String::new();
    for s in sentences.iter().cycle() {
        if engine.tokenizer().encode(&text, false)?.len() >= tokens {
            break;
        }
        if !text.is_empty() {
            text.push(' ');
        }
        text.push_str(s);
    }
    Ok(text)
}

/// The shared-prefix test: time to first token (tokenize, start, first step) of chat
/// requests with one long system prompt and their own user message, with the prefix
/// cache off and on, alternating request by request. With the cache on, each timed
/// request follows one untimed request with the same system prompt, so it finds the
/// prompt's blocks cached, as every request after the first would in a server.
fn shared_prefix_ttft<B: Backend>(
    engine: &Engine<B>,
    args: &BenchArgs,
    tag: &str,
) -> anyhow::Result<()> {
    use crate::engine::{chat::ChatMessage, Prompt};
    let system = system_prompt(engine, args.shared_prefix)?;
    let request = |i: usize| {
        Prompt::Chat(vec![
            ChatMessage::new("system", system.clone()),
            ChatMessage::new("user", serving_prompt(i)),
        ])
    };
    let ttft = |i: usize| -> anyhow::Result<(f64, usize)> {
        let t = Instant::now();
        let ids = engine.encode_prompt(&request(i))?;
        let n = ids.len();
        let mut seq = engine.start(ids, GenerateParams::default())?;
        engine.step(&mut [&mut seq])?;
        Ok((t.elapsed().as_secs_f64() * 1e3, n))
    };
    let budget = args.prefix_cache_mib.saturating_mul(1 << 20);
    let (mut off, mut on) = (Vec::new(), Vec::new());
    let mut prompt_tokens = 0;
    let reused_before = engine.prefix_stats().reused_tokens;
    // One untimed round first: page in, warm the allocator.
    for i in 0..args.reps.max(1) + 1 {
        engine.set_prefix_cache(0);
        let (ms, n) = ttft(2 * i)?;
        prompt_tokens = n;
        engine.set_prefix_cache(budget);
        ttft(1_000_000 + i)?;
        let (ms_on, _) = ttft(2 * i + 1)?;
        if i > 0 {
            off.push(ms);
            on.push(ms_on);
        }
    }
    engine.set_prefix_cache(0);
    off.sort_by(f64::total_cmp);
    on.sort_by(f64::total_cmp);
    let (off, on) = (percentile(&off, 50.0), percentile(&on, 50.0));
    let reused = engine.prefix_stats().reused_tokens - reused_before;
    let per_request = reused as f64 / (args.reps.max(1) + 1) as f64;
    println!("baton ttft prefix_cache=off prompt={prompt_tokens} {tag} ms={off:.1}");
    println!(
        "baton ttft prefix_cache=on prompt={prompt_tokens} reused={per_request:.0} {tag} ms={on:.1}"
    );
    println!("baton ttft ratio off/on={:.2}", off / on);
    Ok(())
}

/// Arguments of `bench-serve`: the engine thread driven in-process, as the cluster
/// drives it, for comparison with the same load sent through the coordinator
/// (`scripts/bench-serving`).
#[derive(Debug, Args)]
pub struct ServeBenchArgs {
    /// GGUF model file.
    #[arg(long, env = baton_common::env::MODEL, default_value = "models/SmolLM2-135M-Instruct.Q4_1.gguf")]
    pub model: PathBuf,
    /// Weight format.
    #[arg(long, default_value = "native-i16")]
    pub dtype: WeightDtype,
    /// How the host KV store keeps keys and values: f16 or f32.
    #[arg(long, default_value_t = crate::engine::llama::KvDtype::default())]
    pub kv_dtype: crate::engine::llama::KvDtype,
    /// Requests per second, sent at fixed times (open loop: arrivals do not wait for
    /// completions, so neither side's timing shapes its own load).
    #[arg(long, default_value_t = 4.0)]
    pub rate: f64,
    /// Requests in all.
    #[arg(long, default_value_t = 16)]
    pub requests: usize,
    /// Tokens per request.
    #[arg(long, default_value_t = 32)]
    pub max_tokens: u32,
    /// Most sequences the engine runs at once.
    #[arg(long, default_value_t = 16)]
    pub max_running: usize,
    /// Use the simulated engine (fixed step time, no model): isolates the serving path.
    #[arg(long)]
    pub simulated: bool,
    /// Milliseconds per step of the simulated engine.
    #[arg(long, default_value_t = 20)]
    pub sim_step_ms: u64,
    /// Prefix cache budget in MiB (0: off); the default is a worker's (`cluster.toml`'s
    /// `worker.prefix_cache_mib` default), so that both sides reuse shared prompt
    /// prefixes alike.
    #[arg(long, default_value_t = baton_common::config::WorkerConfig::default().prefix_cache_mib)]
    pub prefix_cache_mib: u64,
    /// Most tokens a step runs (0: no limit); the default is a worker's
    /// (`worker.max_step_tokens`).
    #[arg(long, default_value_t = baton_common::config::WorkerConfig::default().max_step_tokens)]
    pub max_step_tokens: u32,
    /// When each request is sent: a file with one offset in seconds from the start per
    /// line, one line per request (overrides `--rate`'s fixed intervals).
    /// `scripts/bench-serving` writes one with Poisson arrivals and gives both sides
    /// the same file.
    #[arg(long)]
    pub schedule: Option<PathBuf>,
    /// Scheduling class of the compute threads, as a worker's `compute_priority` (the
    /// same default, so that both sides of the comparison run alike).
    #[arg(long, default_value = "idle")]
    pub compute_priority: crate::compute::ComputePriority,
}

/// When each of `requests` requests is sent, from the start: `schedule`'s offsets
/// (seconds, one per line), or one every `1 / rate` seconds.
pub fn arrivals(
    schedule: Option<&std::path::Path>,
    rate: f64,
    requests: usize,
) -> anyhow::Result<Vec<std::time::Duration>> {
    use anyhow::Context as _;
    let Some(path) = schedule else {
        let interval = 1.0 / rate.max(1e-3);
        return Ok((0..requests)
            .map(|i| std::time::Duration::from_secs_f64(i as f64 * interval))
            .collect());
    };
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("reading the schedule {}", path.display()))?;
    let offsets = text
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| {
            l.trim()
                .parse::<f64>()
                .ok()
                .filter(|s| s.is_finite() && *s >= 0.0)
                .map(std::time::Duration::from_secs_f64)
                .with_context(|| format!("{}: {l:?} is not an offset in seconds", path.display()))
        })
        .collect::<anyhow::Result<Vec<_>>>()?;
    anyhow::ensure!(
        offsets.len() >= requests,
        "{} has {} offsets for {requests} requests",
        path.display(),
        offsets.len()
    );
    Ok(offsets[..requests].to_vec())
}

/// The prompt of request `i` of a serving benchmark (`scripts/bench-serving` sends the
/// same text).
pub fn serving_prompt(i: usize) -> String {
    format!("Request {i}: write a short story about a lighthouse keeper and the sea.")
}

/// Percentile (0–100) of sorted values, nearest rank.
pub fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let rank = (p / 100.0 * (sorted.len() - 1) as f64).round() as usize;
    sorted[rank.min(sorted.len() - 1)]
}

/// Runs `bench-serve` and prints an `inproc …` line.
pub fn run_serve(args: &ServeBenchArgs) -> anyhow::Result<()> {
    use crate::serve::{
        real::RealEngine,
        scheduler::{self, Command, Limits, Load},
        sim::SimEngine,
    };
    use baton_common::{
        ids::{CoordinatorId, StreamId},
        protocol::{ChatTurn, EventKind, GenParams, PromptSpec, SeqRequest, SubmitOutcome},
    };
    use std::{
        collections::HashMap,
        sync::{Arc, Mutex},
        time::Duration,
    };

    crate::compute::init(0, args.compute_priority);
    let name = "bench".to_string();
    let (cmd_tx, cmd_rx) = std::sync::mpsc::channel();
    let (out_tx, mut out_rx) = tokio::sync::mpsc::unbounded_channel();
    let limits = Limits {
        max_running: args.max_running,
        max_queued: args.requests,
        kv_budget: u64::MAX,
    };
    let load = Arc::new(Load::default());
    let engine_thread = if args.simulated {
        let sim = SimEngine::new(name.clone(), Duration::from_millis(args.sim_step_ms));
        std::thread::spawn(move || scheduler::run(sim, no_loads(), limits, cmd_rx, out_tx, load))
    } else {
        let mut engine = Engine::<crate::backend::CpuBackend>::load(
            &args.model,
            args.dtype,
            &Default::default(),
        )?;
        engine.set_kv_dtype(args.kv_dtype);
        engine.set_prefix_cache(
            usize::try_from(args.prefix_cache_mib.saturating_mul(1 << 20)).unwrap_or(usize::MAX),
        );
        engine.set_step_tokens(args.max_step_tokens as usize);
        let real = RealEngine::new(engine, name.clone());
        std::thread::spawn(move || scheduler::run(real, no_loads(), limits, cmd_rx, out_tx, load))
    };

    // Arrivals: request i is sent at its offset (open loop), by one sender thread.
    let offsets = arrivals(args.schedule.as_deref(), args.rate, args.requests)?;
    let sent_at: Arc<Mutex<HashMap<StreamId, Instant>>> = Arc::default();
    let start = Instant::now();
    let sender = {
        let sent_at = sent_at.clone();
        let (requests, max_tokens) = (args.requests, args.max_tokens);
        std::thread::spawn(move || -> anyhow::Result<()> {
            let coordinator = CoordinatorId::random();
            let mut replies = Vec::with_capacity(requests);
            for (i, offset) in offsets.into_iter().enumerate().take(requests) {
                let due = start + offset;
                std::thread::sleep(due.saturating_duration_since(Instant::now()));
                let stream = StreamId::random();
                let (tx, rx) = tokio::sync::oneshot::channel();
                let at = Instant::now();
                sent_at.lock().expect("not poisoned").insert(stream, at);
                cmd_tx.send(Command::Submit {
                    coordinator,
                    sequences: vec![SeqRequest {
                        stream,
                        model: name.clone(),
                        prompt: PromptSpec::Chat(vec![ChatTurn::new("user", serving_prompt(i))]),
                        params: GenParams {
                            ignore_eos: true,
                            ..GenParams::greedy(max_tokens)
                        },
                        attempt: 0,
                        resume: None,
                        max_prompt_tokens: 0,
                    }],
                    reply: tx,
                })?;
                // Not waited for here: the engine answers between two steps, and the
                // next arrival must not wait for that.
                replies.push(rx);
            }
            for rx in replies {
                for outcome in rx.blocking_recv()? {
                    if let SubmitOutcome::Refused(r) = outcome {
                        anyhow::bail!("the engine refused a request: {}", r.error.message);
                    }
                }
            }
            Ok(())
        })
    };
    let mut ttft = Vec::new();
    let mut tokens = 0usize;
    let mut done = 0;
    while done < args.requests {
        let Some(outbox) = out_rx.blocking_recv() else {
            anyhow::bail!("engine thread ended early");
        };
        let now = Instant::now();
        for (_, events) in outbox {
            for ev in events {
                match ev.kind {
                    EventKind::Token(t) => {
                        tokens += 1;
                        if t.index == 0 {
                            if let Some(at) = sent_at.lock().expect("not poisoned").get(&ev.stream)
                            {
                                ttft.push((now - *at).as_secs_f64() * 1e3);
                            }
                        }
                    }
                    EventKind::Finished(_) | EventKind::Failed(_) => done += 1,
                    EventKind::Prompt(_) | EventKind::Progress(_) => {}
                }
            }
        }
    }
    let wall = start.elapsed().as_secs_f64();
    sender
        .join()
        .map_err(|_| anyhow::anyhow!("sender thread panicked"))??;
    let _ = engine_thread.join();
    ttft.sort_by(f64::total_cmp);
    println!(
        "inproc rate={} requests={} tokens={} tok_s={:.1} ttft_p50_ms={:.1} ttft_p99_ms={:.1}",
        args.rate,
        args.requests,
        tokens,
        tokens as f64 / wall,
        percentile(&ttft, 50.0),
        percentile(&ttft, 99.0)
    );
    Ok(())
}

/// The bench serves one model: it asks for no other.
fn no_loads<E>() -> crate::serve::scheduler::Loader<E> {
    std::sync::Arc::new(|_: &crate::serve::scheduler::LoadSpec| {
        anyhow::bail!("the bench loads no other model")
    })
}
