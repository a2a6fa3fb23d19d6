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
    /// Weight dtype kept in memory: f32 or f16.
    #[arg(long, default_value = "f32")]
    pub dtype: WeightDtype,
    /// Prompt length of the prefill test.
    #[arg(long, default_value_t = 128)]
    pub prompt_tokens: usize,
    /// Tokens generated in the decode test.
    #[arg(long, default_value_t = 64)]
    pub gen_tokens: usize,
    /// Repetitions; the best is reported (the machine is shared and noisy).
    #[arg(long, default_value_t = 3)]
    pub reps: usize,
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
    let threads = rayon::current_num_threads();
    let tag = format!("dtype={:?} threads={threads}", args.dtype).to_lowercase();
    let t0 = Instant::now();
    let engine = Engine::<B>::load(&args.model, args.dtype, device)?;
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
    for _ in 0..args.reps.max(1) + 1 {
        let mut cache = model.new_cache();
        let t = Instant::now();
        let logits = model.forward(&mut [SeqInput {
            tokens: &prompt,
            cache: &mut cache,
        }])?;
        let _ = crate::engine::llama::Llama::<B>::logits_to_host(logits);
        best_pp = best_pp.min(t.elapsed().as_secs_f64());
    }
    println!(
        "baton pp{} {tag} tok_s={:.1}",
        args.prompt_tokens,
        args.prompt_tokens as f64 / best_pp
    );

    let mut best_tg = f64::MAX;
    for _ in 0..args.reps.max(1) {
        let params = GenerateParams {
            max_tokens: args.gen_tokens + 1,
            ignore_eos: true,
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
    if let Some(rss) = peak_rss_bytes() {
        println!(
            "baton peak_rss {tag} mib={:.0}",
            rss as f64 / (1024.0 * 1024.0)
        );
    }
    Ok(())
}
