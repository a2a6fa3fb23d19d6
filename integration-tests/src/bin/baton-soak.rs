//! `baton-soak`: a bounded soak against a local cluster, one verdict line.
//!
//! ```text
//! baton-soak [--simulated] [--minutes N] [--kill-every-s N] [--concurrency N] [--max-tokens N]
//!            [--weights FORMAT] [--coordinator 'KEY = VALUE']...
//! ```
//!
//! `--weights` sets the workers' `worker.weights` (`native`, `native-i16`, `native-i8`, `f16`, `f32`);
//! each `--coordinator` line goes into the `[coordinator]` section of the cluster's
//! `cluster.toml` (`--coordinator 'reconnect_window_s = 60'`).
//!
//! Starts a private `nats-server`, a coordinator (with its checkpoint store) and two
//! workers (the default model, or the simulated engine), runs
//! [`baton_integration_tests::soak`], prints the memory samples and the verdict line, and
//! exits 1 if any stream failed or differed from an uninterrupted run.

use std::process::ExitCode;
use std::time::Duration;

use baton_integration_tests::soak::{self, SoakOptions};
use baton_integration_tests::{Cluster, ClusterOptions};

const USAGE: &str = "usage: baton-soak [--simulated] [--minutes N] [--kill-every-s N] \
                     [--concurrency N] [--max-tokens N] [--weights FORMAT] \
                     [--coordinator 'KEY = VALUE']...";

/// The weight formats a worker takes (`worker.weights`).
const WEIGHTS: [&str; 5] = ["native", "native-i16", "native-i8", "f16", "f32"];

fn parse() -> Result<(bool, Option<String>, Vec<String>, SoakOptions), String> {
    let mut simulated = false;
    let mut weights = None;
    let mut coordinator = Vec::new();
    let mut options = SoakOptions::default();
    let mut it = std::env::args().skip(1);
    while let Some(a) = it.next() {
        let mut number = |name: &str| -> Result<f64, String> {
            it.next()
                .and_then(|v| v.parse::<f64>().ok())
                .filter(|v| v.is_finite() && *v > 0.0)
                .ok_or_else(|| format!("{name} takes a positive number"))
        };
        match a.as_str() {
            "--simulated" => simulated = true,
            "--minutes" => options.duration = Duration::from_secs_f64(number(&a)? * 60.0),
            "--kill-every-s" => options.kill_every = Duration::from_secs_f64(number(&a)?),
            "--concurrency" => options.concurrency = number(&a)? as usize,
            "--max-tokens" => options.max_tokens = number(&a)? as u32,
            "--weights" => {
                let w = it.next().unwrap_or_default();
                if !WEIGHTS.contains(&w.as_str()) {
                    return Err(format!("--weights takes one of {}", WEIGHTS.join(", ")));
                }
                weights = Some(w);
            }
            "--coordinator" => coordinator.push(
                it.next()
                    .filter(|line| line.contains('='))
                    .ok_or("--coordinator takes a `key = value` line")?,
            ),
            "-h" | "--help" => return Err(USAGE.into()),
            other => return Err(format!("unknown argument {other:?}\n{USAGE}")),
        }
    }
    if options.concurrency == 0 || options.max_tokens == 0 {
        return Err("--concurrency and --max-tokens take whole numbers from 1".into());
    }
    Ok((simulated, weights, coordinator, options))
}

fn main() -> ExitCode {
    let (simulated, weights, coordinator, options) = match parse() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("{e}");
            return ExitCode::from(2);
        }
    };
    let mut cluster_options = if simulated {
        ClusterOptions::simulated(2).step_ms(20)
    } else {
        ClusterOptions::real(2)
    };
    if let Some(w) = &weights {
        cluster_options
            .extra
            .push(("worker", format!("weights = \"{w}\"")));
    }
    for line in coordinator {
        cluster_options.extra.push(("coordinator", line));
    }
    let Some(mut cluster) = Cluster::start(cluster_options) else {
        eprintln!("baton-soak: cannot start a cluster (see the note above)");
        return ExitCode::from(2);
    };
    eprintln!(
        "baton-soak: {}{}, {:.1} min, {} streams in flight, {} tokens each, \
         kill -9 worker B every {} s",
        if simulated {
            "simulated engine"
        } else {
            "default model"
        },
        weights.map_or(String::new(), |w| format!(" ({w} weights)")),
        options.duration.as_secs_f64() / 60.0,
        options.concurrency,
        options.max_tokens,
        options.kill_every.as_secs()
    );
    let report = soak::run(&mut cluster, &options);
    print!("{}", report.samples_table());
    for p in &report.problems {
        println!("    {p}");
    }
    for f in &report.failures {
        println!("    {f}");
    }
    println!("{}", report.line());
    if report.ok() {
        ExitCode::SUCCESS
    } else {
        println!("logs:\n{}", cluster.logs());
        ExitCode::FAILURE
    }
}
