//! `baton bench`: the per-token cost of each transport, measured in one run.
//!
//! Each round streams the same greedy request once over HTTP SSE, once over NATS with
//! JSON replies and once over NATS with rkyv replies, in turn, so that every transport
//! sees the same cluster state. Per request it notes the time to the first text and
//! the time per token after it ((end − first) / (tokens − 1)); the table gives medians
//! and means over the rounds. Run it against a fast (simulated) engine to see the
//! transport's share; against a real model the engine's step time dominates.

use std::time::{Duration, Instant};

use clap::Args;
use futures::StreamExt;

use crate::cli::Cli;
use crate::{Client, Event, Request};

/// Arguments of `bench`.
#[derive(Debug, Args)]
pub struct BenchArgs {
    /// Model name.
    #[arg(long, short)]
    pub model: String,
    /// Measured rounds (each streams one request per transport).
    #[arg(long, default_value_t = 30)]
    pub rounds: usize,
    /// Unmeasured rounds first.
    #[arg(long, default_value_t = 3)]
    pub warmup: usize,
    /// Tokens per request (end-of-sequence is ignored).
    #[arg(long, default_value_t = 128)]
    pub max_tokens: u32,
    /// The prompt.
    #[arg(long, default_value = "Once upon a time")]
    pub prompt: String,
}

/// One streamed request's timings.
#[derive(Debug, Clone, Copy)]
struct Sample {
    first: Duration,
    per_token: Duration,
}

/// Streams `request` and times it.
async fn sample(client: &Client, request: &Request) -> anyhow::Result<Sample> {
    let start = Instant::now();
    let mut events = client.stream(request).await?;
    let mut first = None;
    let mut tokens = 0u32;
    while let Some(event) = events.next().await {
        match event? {
            Event::Text { .. } => {
                first.get_or_insert_with(|| start.elapsed());
            }
            Event::Finished(f) => tokens = f.completion_tokens,
        }
    }
    let total = start.elapsed();
    let first = first.unwrap_or(total);
    let per_token = (total - first) / tokens.saturating_sub(1).max(1);
    Ok(Sample { first, per_token })
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v.get(v.len() / 2).copied().unwrap_or_default()
}

fn mean(v: &[Duration]) -> Duration {
    if v.is_empty() {
        return Duration::ZERO;
    }
    v.iter().sum::<Duration>() / v.len() as u32
}

fn micros(d: Duration) -> f64 {
    d.as_secs_f64() * 1e6
}

/// Runs the benchmark and prints a Markdown table.
pub async fn run(cli: &Cli, args: &BenchArgs) -> anyhow::Result<()> {
    let url = cli
        .url
        .as_deref()
        .ok_or_else(|| anyhow::anyhow!("bench needs --url (the coordinator's HTTP API)"))?;
    let nats = Client::connect_nats_with(&crate::cli::nats_config(cli)).await?;
    let transports = [
        ("HTTP SSE", crate::cli::http_client(cli, url)?),
        ("NATS JSON", nats.clone().json_replies(true)),
        ("NATS rkyv", nats.json_replies(false)),
    ];
    let mut request = Request::completion(&args.model, &args.prompt);
    request.max_tokens = Some(args.max_tokens);
    request.temperature = Some(0.0);
    request.ignore_eos = true;
    let mut samples: Vec<Vec<Sample>> = vec![Vec::new(); transports.len()];
    for round in 0..args.warmup + args.rounds {
        for (i, (_, client)) in transports.iter().enumerate() {
            let s = sample(client, &request).await?;
            if round >= args.warmup {
                samples[i].push(s);
            }
        }
    }
    println!(
        "{} rounds × {} tokens, one stream at a time\n",
        args.rounds, args.max_tokens
    );
    println!("| transport | per token, median (µs) | per token, mean (µs) | first text, median (µs) | vs HTTP SSE per token (µs) |");
    println!("| --- | ---: | ---: | ---: | ---: |");
    let base = median(samples[0].iter().map(|s| s.per_token).collect());
    for ((name, _), s) in transports.iter().zip(&samples) {
        let per: Vec<Duration> = s.iter().map(|s| s.per_token).collect();
        let med = median(per.clone());
        println!(
            "| {name} | {:.1} | {:.1} | {:.0} | {:+.1} |",
            micros(med),
            micros(mean(&per)),
            micros(median(s.iter().map(|s| s.first).collect())),
            micros(med) - micros(base),
        );
    }
    Ok(())
}
