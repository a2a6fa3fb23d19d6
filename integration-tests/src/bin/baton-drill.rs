//! `baton-drill`: the failover drills against a local cluster, one verdict line each.
//!
//! ```text
//! baton-drill [--simulated] [--secure] [--kills N] [--runs N] [--max-tokens N]
//!             [--nats-servers N]
//! ```
//!
//! Starts a private `nats-server`, a coordinator and two workers (the default model, or
//! the simulated engine), runs every drill of [`baton_integration_tests::drill`] with
//! greedy and with seeded sampling, prints one line per drill, and exits 1 if any
//! stream did not end exactly as an uninterrupted run. With `--secure`, NATS enforces
//! `docs/nats-accounts.conf` over mutual TLS, and every process connects with its
//! role's credentials and a client certificate (so NATS restarts test re-authentication).
//! Then a second cluster runs on `--nats-servers` (3) `nats-server`s joined by routes, with
//! JetStream and `sync` checkpoints: one server is killed mid-stream, `--runs` times with
//! each sampling (0 skips it), then the coordinator of four streams is killed with its
//! store deleted and the clients reconnect to a second coordinator.

use std::process::ExitCode;
use std::sync::Arc;

use baton_integration_tests::drill::{self, Sampling, Verdict};
use baton_integration_tests::secure::NatsSecurity;
use baton_integration_tests::{Cluster, ClusterOptions};

struct Args {
    simulated: bool,
    secure: bool,
    kills: usize,
    runs: usize,
    max_tokens: u32,
    nats_servers: usize,
}

fn parse() -> Result<Args, String> {
    let mut args = Args {
        simulated: false,
        secure: false,
        kills: 20,
        runs: 3,
        max_tokens: 48,
        nats_servers: 3,
    };
    let mut it = std::env::args().skip(1);
    while let Some(a) = it.next() {
        let mut number = |name: &str| -> Result<usize, String> {
            it.next()
                .and_then(|v| v.parse().ok())
                .ok_or_else(|| format!("{name} takes a number"))
        };
        match a.as_str() {
            "--simulated" => args.simulated = true,
            "--secure" => args.secure = true,
            "--kills" => args.kills = number("--kills")?,
            "--runs" => args.runs = number("--runs")?,
            "--max-tokens" => args.max_tokens = number("--max-tokens")? as u32,
            "--nats-servers" => args.nats_servers = number("--nats-servers")?,
            "-h" | "--help" => {
                return Err(
                    "usage: baton-drill [--simulated] [--secure] [--kills N] [--runs N] \
                     [--max-tokens N] [--nats-servers N]"
                        .into(),
                )
            }
            other => return Err(format!("unknown argument {other:?}")),
        }
    }
    Ok(args)
}

/// Prints a drill's verdict line, then what went wrong, a line each.
fn report(v: &Verdict) {
    println!("{}", v.line());
    for f in &v.failures {
        println!("    {f}");
    }
}

fn main() -> ExitCode {
    let args = match parse() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("{e}");
            return ExitCode::from(2);
        }
    };
    let base = if args.simulated {
        ClusterOptions::simulated(2).step_ms(20)
    } else {
        ClusterOptions::real(2)
    };
    let mut options = base.clone();
    if args.secure {
        options = options.secured(Arc::new(NatsSecurity::new().with_tls(true)));
    }
    let Some(mut cluster) = Cluster::start(options) else {
        eprintln!("baton-drill: cannot start a cluster (see the note above)");
        return ExitCode::from(2);
    };
    let mut verdicts: Vec<Verdict> = Vec::new();
    for sampling in [Sampling::Greedy, Sampling::Seeded(7)] {
        let drills: [(&str, usize); 7] = [
            ("kill", args.kills),
            ("kill-json", args.kills),
            ("kill-tools", args.runs),
            ("sigterm", args.runs),
            ("coordinator", args.runs),
            ("nats", args.runs),
            ("swap", args.runs),
        ];
        for (which, runs) in drills {
            // The simulated worker makes numbered tokens; it runs no grammar, and loads
            // no model file.
            if matches!(which, "kill-json" | "kill-tools" | "swap") && args.simulated {
                continue;
            }
            let v = match which {
                "kill" => drill::kill_worker(&mut cluster, sampling, runs, args.max_tokens),
                // A schema's output needs room to end: at least 200 tokens.
                "kill-json" => drill::kill_worker_structured(
                    &mut cluster,
                    sampling,
                    runs,
                    args.max_tokens.max(200),
                ),
                "kill-tools" => drill::kill_worker_tool_call(
                    &mut cluster,
                    sampling,
                    runs,
                    args.max_tokens.max(200),
                ),
                "sigterm" => drill::stop_worker(&mut cluster, sampling, runs, args.max_tokens),
                "coordinator" => {
                    drill::restart_coordinator(&mut cluster, sampling, runs, args.max_tokens)
                }
                "nats" => drill::restart_nats(&mut cluster, sampling, runs, args.max_tokens),
                // Streams long enough to be running when the new model takes over.
                _ => drill::swap_model(
                    &mut cluster,
                    sampling,
                    runs,
                    args.max_tokens.max(64),
                    &baton_integration_tests::cluster::default_model_path(),
                ),
            };
            report(&v);
            verdicts.push(v);
        }
    }
    let mut logs = cluster.logs();
    drop(cluster);
    // A NATS cluster loses a server: the first cluster's NATS is one server.
    if args.nats_servers > 1 && args.runs > 0 {
        if args.secure {
            println!(
                "(the NATS-cluster drill runs without --secure: the harness secures one server)"
            );
        }
        // With JetStream, in sync mode: the checkpoints outlive a coordinator's host.
        let mut options = base.clone().nats_servers(args.nats_servers).jetstream();
        options.extra.push((
            "coordinator",
            "checkpoint = \"sync\"\njetstream = \"on\"\nlease_ms = 1000".into(),
        ));
        let Some(mut cluster) = Cluster::start(options) else {
            eprintln!(
                "baton-drill: cannot start a cluster on {} nats-servers",
                args.nats_servers
            );
            return ExitCode::from(2);
        };
        for sampling in [Sampling::Greedy, Sampling::Seeded(7)] {
            let v = drill::kill_nats_member(&mut cluster, sampling, args.runs, args.max_tokens);
            report(&v);
            if !v.ok() {
                logs.push_str(&cluster.logs());
            }
            verdicts.push(v);
        }
        // A coordinator of 4 streams dies with its disk; clients go to another one.
        let other = cluster.start_coordinator();
        for sampling in [Sampling::Greedy, Sampling::Seeded(7)] {
            let v = drill::lose_coordinator(
                &mut cluster,
                &other.api,
                sampling,
                args.runs,
                4,
                args.max_tokens,
            );
            report(&v);
            if !v.ok() {
                logs.push_str(&cluster.logs());
                logs.push_str(&other.process.log());
            }
            verdicts.push(v);
        }
    }
    // Partitions: every process in a network namespace of its own, on three servers.
    if args.runs > 0 {
        match Cluster::start(base.clone().nats_servers(3).partitioned()) {
            None => println!("(the partition drill was skipped: see the note above)"),
            Some(mut cluster) => {
                for sampling in [Sampling::Greedy, Sampling::Seeded(7)] {
                    let v = drill::partition(&mut cluster, sampling, args.runs, args.max_tokens);
                    report(&v);
                    if !v.ok() {
                        logs.push_str(&cluster.logs());
                    }
                    verdicts.push(v);
                }
            }
        }
    }
    if verdicts.iter().all(Verdict::ok) {
        println!("all drills passed");
        ExitCode::SUCCESS
    } else {
        println!("some drills FAILED; logs:\n{logs}");
        ExitCode::FAILURE
    }
}
