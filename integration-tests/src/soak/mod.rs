//! A bounded soak: steady load on a cluster for a set time, with one worker killed
//! (`kill -9`) every few minutes, every stream checked against an uninterrupted run.
//!
//! `concurrency` clients each keep one stream in flight, one after another, cycling
//! through a mix of requests ([`shapes`]: several prompts, chat and text completions,
//! greedy and seeded sampling). Every `kill_every` the worker in slot [`KILLED_SLOT`]
//! (worker B) is killed and, `restart_after` later, started again as a new process;
//! worker A (slot [`LIVE_SLOT`]) lives the whole run, so that its memory can be compared
//! from start to end.
//!
//! Before the load starts, each request of the mix runs once alone: that is its
//! reference (the engine is deterministic for greedy and for a given seed). Each soak
//! stream must match its reference token by token — same positions with the same text,
//! event ids going up by one (except where the reference skips a token with no text of
//! its own), the same finish reason and usage — and the token ids the workers sent
//! (seen by the [`TokenTap`]) must be the reference's. The resident set sizes of the
//! coordinator and worker A are sampled after a warm-up, every tenth of the run and at
//! the end, with the streams the coordinator holds and keeps in its store.
//!
//! `scripts/soak` runs it (`baton-soak`); an integration test runs a short simulated one.

mod check;

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::drill::Sampling;
use crate::tap::TokenTap;
use crate::{Api, Cluster};
pub use check::{compare, record, Diff, Record, Reference};

/// The worker slot killed every `kill_every` (worker B).
pub const KILLED_SLOT: usize = 1;

/// The worker slot never killed (worker A), whose memory is watched.
pub const LIVE_SLOT: usize = 0;

/// How long the tap may lag behind a client at the end of a stream.
const TAP_WAIT: Duration = Duration::from_secs(5);

/// Failures kept for printing, at most.
const KEPT_FAILURES: usize = 50;

/// What to run.
#[derive(Debug, Clone)]
pub struct SoakOptions {
    /// How long the load runs.
    pub duration: Duration,
    /// Time between two kills of worker B.
    pub kill_every: Duration,
    /// Time from a kill to the start of B's replacement.
    pub restart_after: Duration,
    /// Streams in flight at once.
    pub concurrency: usize,
    /// `max_tokens` of every request.
    pub max_tokens: u32,
}

impl Default for SoakOptions {
    fn default() -> Self {
        SoakOptions {
            duration: Duration::from_secs(30 * 60),
            kill_every: Duration::from_secs(180),
            restart_after: Duration::from_secs(3),
            concurrency: 4,
            max_tokens: 64,
        }
    }
}

impl SoakOptions {
    /// Load before the first memory sample: a tenth of the run, at most a minute.
    pub fn warmup(&self) -> Duration {
        (self.duration / 10).min(Duration::from_secs(60))
    }

    /// Time between memory samples: a tenth of the run.
    pub fn sample_every(&self) -> Duration {
        (self.duration / 10).max(Duration::from_secs(1))
    }
}

/// One request of the mix.
#[derive(Debug, Clone)]
pub struct Shape {
    /// `/v1/chat/completions` or `/v1/completions`.
    pub path: &'static str,
    /// The request body (`stream: true`, usage included).
    pub body: Value,
    /// A short name for messages.
    pub label: String,
}

const PROMPTS: [&str; 8] = [
    "Tell me a short story about a lighthouse keeper.",
    "Explain why the sky is blue to a ten year old.",
    "Write a haiku about autumn rain.",
    "List three tips for learning to cook.",
    "What is the capital of France, and what is it known for?",
    "Describe a busy train station in the morning.",
    "Give me a recipe for a simple tomato soup.",
    "Why do cats purr?",
];

/// The mix: each prompt greedy and seeded; two prompts in three as chat completions,
/// the third as a text completion.
pub fn shapes(model: &str, max_tokens: u32) -> Vec<Shape> {
    let mut out = Vec::new();
    for (i, prompt) in PROMPTS.iter().enumerate() {
        for sampling in [Sampling::Greedy, Sampling::Seeded(100 + i as u64)] {
            let chat = i % 3 != 2;
            let (path, mut body) = if chat {
                (
                    "/v1/chat/completions",
                    json!({"model": model, "messages": [
                        {"role": "system", "content": "You are a helpful assistant."},
                        {"role": "user", "content": prompt},
                    ]}),
                )
            } else {
                ("/v1/completions", json!({"model": model, "prompt": prompt}))
            };
            body["max_tokens"] = json!(max_tokens);
            body["stream"] = json!(true);
            body["stream_options"] = json!({"include_usage": true});
            sampling.apply(&mut body);
            let label = format!(
                "prompt {i} ({}, {})",
                if chat { "chat" } else { "text" },
                sampling.name()
            );
            out.push(Shape { path, body, label });
        }
    }
    out
}

/// Counts over every stream of the run.
#[derive(Debug, Clone, Default)]
pub struct Tally {
    /// Streams that ended with `[DONE]`.
    pub completed: usize,
    /// Streams that did not: refused, broken, or ended with an error event.
    pub failed: usize,
    /// Completed streams the tap saw resumed on another worker.
    pub failed_over: usize,
    /// Completed streams identical to their reference.
    pub identical: usize,
    /// Completed streams that differ from their reference.
    pub mismatched: usize,
    /// Of those, streams that never failed over.
    pub mismatched_unmoved: usize,
    /// Tokens of completed streams checked against a reference.
    pub tokens_checked: u64,
    /// Sums of every stream's [`Diff`].
    pub lost: u64,
    /// See [`Diff::repeated`].
    pub repeated: u64,
    /// See [`Diff::differing`].
    pub differing: u64,
    /// See [`Diff::gaps`].
    pub gaps: u64,
    /// Streams whose finish reason, usage or final position differ.
    pub endings: u64,
    /// See [`Diff::ids_checked`].
    pub ids_checked: u64,
    /// See [`Diff::id_mismatches`].
    pub id_mismatches: u64,
    /// See [`Diff::ids_unseen`].
    pub ids_unseen: u64,
}

impl Tally {
    fn add(&mut self, d: &Diff, tokens: u64, failed_over: bool) {
        self.completed += 1;
        self.tokens_checked += tokens;
        if failed_over {
            self.failed_over += 1;
        }
        if d.identical() {
            self.identical += 1;
        } else {
            self.mismatched += 1;
            if !failed_over {
                self.mismatched_unmoved += 1;
            }
        }
        self.lost += d.lost;
        self.repeated += d.repeated;
        self.differing += d.differing;
        self.gaps += d.gaps;
        self.endings += u64::from(d.ending);
        self.ids_checked += d.ids_checked;
        self.id_mismatches += d.id_mismatches;
        self.ids_unseen += d.ids_unseen;
    }
}

/// Resident set sizes at one moment, in KiB.
#[derive(Debug, Clone, Copy)]
pub struct RssSample {
    /// Time since the load started.
    pub at: Duration,
    /// The coordinator's.
    pub coordinator_kib: Option<u64>,
    /// The coordinator's anonymous memory (`RssAnon`): its RSS without the pages of its
    /// binary and libraries.
    pub coordinator_anon_kib: Option<u64>,
    /// Worker A's.
    pub worker_kib: Option<u64>,
    /// What worker A's prefix cache holds (`baton_worker_prefix_cache_bytes`): part of
    /// its RSS, bounded by `worker.prefix_cache_mib`.
    pub worker_cache_kib: Option<u64>,
    /// Streams the coordinator holds (`baton_streams_held`).
    pub held_streams: Option<u64>,
    /// Streams in its checkpoint store at the last collection
    /// (`baton_checkpoint_store_streams`): the held ones and the ended ones kept for
    /// `reconnect_window_s`.
    pub store_streams: Option<u64>,
}

/// How a soak went.
#[derive(Debug, Clone)]
pub struct SoakReport {
    /// What was run.
    pub options: SoakOptions,
    /// How long the load ran.
    pub elapsed: Duration,
    /// Per-stream counts.
    pub tally: Tally,
    /// Times worker B was killed.
    pub kills: usize,
    /// `baton_stream_resumes_total` of the coordinator at the end, all causes.
    pub resumes: Option<u64>,
    /// Memory samples: the first after the warm-up, the last at the end.
    pub samples: Vec<RssSample>,
    /// What went wrong with streams (the first fifty).
    pub failures: Vec<String>,
    /// What went wrong with the run itself (a reference, a process that died).
    pub problems: Vec<String>,
}

impl SoakReport {
    fn new(options: &SoakOptions) -> SoakReport {
        SoakReport {
            options: options.clone(),
            elapsed: Duration::ZERO,
            tally: Tally::default(),
            kills: 0,
            resumes: None,
            samples: Vec::new(),
            failures: Vec::new(),
            problems: Vec::new(),
        }
    }

    /// Whether every stream completed identical to its reference, and the run went as
    /// planned.
    pub fn ok(&self) -> bool {
        self.problems.is_empty()
            && self.tally.completed > 0
            && self.tally.failed == 0
            && self.tally.mismatched == 0
    }

    /// The verdict line.
    pub fn line(&self) -> String {
        let t = &self.tally;
        let mib =
            |kib: Option<u64>| kib.map_or("-".into(), |k| format!("{:.1}", k as f64 / 1024.0));
        let rss = |pick: fn(&RssSample) -> Option<u64>| {
            let start = self.samples.first().and_then(pick);
            let end = self.samples.last().and_then(pick);
            let max = self.samples.iter().filter_map(pick).max();
            format!("{} -> {} MiB (max {})", mib(start), mib(end), mib(max))
        };
        format!(
            "{} soak {:.1} min, {} streams in flight, kill -9 worker B every {} s: \
             {} streams completed, {} failed, {} failed over ({} resumes), {} kills; \
             {} tokens checked: {} lost, {} repeated, {} differing, {} id gaps, {} endings differ; \
             token ids {} checked, {} differ, {} unseen; {} streams differ ({} never moved); \
             RSS coordinator {} (anonymous {}), worker A {} (prefix cache {})",
            if self.ok() { "PASS" } else { "FAIL" },
            self.elapsed.as_secs_f64() / 60.0,
            self.options.concurrency,
            self.options.kill_every.as_secs(),
            t.completed,
            t.failed,
            t.failed_over,
            self.resumes.map_or("-".into(), |n| n.to_string()),
            self.kills,
            t.tokens_checked,
            t.lost,
            t.repeated,
            t.differing,
            t.gaps,
            t.endings,
            t.ids_checked,
            t.id_mismatches,
            t.ids_unseen,
            t.mismatched,
            t.mismatched_unmoved,
            rss(|s| s.coordinator_kib),
            rss(|s| s.coordinator_anon_kib),
            rss(|s| s.worker_kib),
            rss(|s| s.worker_cache_kib),
        )
    }

    /// The memory samples, one line each.
    pub fn samples_table(&self) -> String {
        let mut out = String::from(
            "  time     coordinator  (anonymous)  worker A  (RSS, MiB)  \
             worker A's prefix cache (MiB)  streams held  in store\n",
        );
        for s in &self.samples {
            let mib =
                |k: Option<u64>| k.map_or("-".into(), |k| format!("{:.1}", k as f64 / 1024.0));
            let count = |n: Option<u64>| n.map_or("-".into(), |n| n.to_string());
            out.push_str(&format!(
                "  {:>6.1}s  {:>11}  {:>11}  {:>8}  {:>41}  {:>12}  {:>8}\n",
                s.at.as_secs_f64(),
                mib(s.coordinator_kib),
                mib(s.coordinator_anon_kib),
                mib(s.worker_kib),
                mib(s.worker_cache_kib),
                count(s.held_streams),
                count(s.store_streams)
            ));
        }
        out
    }
}

/// Shared by the client threads.
struct Clients<'a> {
    api: Api,
    shapes: &'a [Shape],
    references: &'a [Reference],
    tap: &'a TokenTap,
    next: AtomicUsize,
    stop: AtomicBool,
    report: Mutex<(Tally, Vec<String>)>,
}

impl Clients<'_> {
    /// Runs streams one after another until told to stop.
    fn run(&self) {
        while !self.stop.load(Ordering::Relaxed) {
            let k = self.next.fetch_add(1, Ordering::Relaxed) % self.shapes.len();
            self.one(k);
        }
    }

    fn one(&self, k: usize) {
        let shape = &self.shapes[k];
        let reference = &self.references[k];
        let (stream, outcome) = stream_once(&self.api, shape);
        let mut report = match outcome {
            Ok(run) => {
                let tapped = self.tap.take(&run.stream, TAP_WAIT);
                let d = compare(&run, tapped.as_ref(), reference);
                let failed_over = tapped.as_ref().is_some_and(|t| t.failed_over());
                let mut report = self.report.lock().expect("report lock");
                report.0.add(&d, reference.tokens(), failed_over);
                if !d.identical() {
                    let text = format!(
                        "{}, stream {}{}: {d:?}\n      got  {:?}\n      want {:?}",
                        shape.label,
                        run.stream,
                        if failed_over { " (failed over)" } else { "" },
                        run.text(),
                        reference.record.text()
                    );
                    report.1.push(text);
                }
                report
            }
            Err(e) => {
                if let Some(s) = &stream {
                    self.tap.forget(s);
                }
                let mut report = self.report.lock().expect("report lock");
                report.0.failed += 1;
                let text = format!(
                    "{}, stream {}: {e}",
                    shape.label,
                    stream.as_deref().unwrap_or("?")
                );
                report.1.push(text);
                report
            }
        };
        report.1.truncate(KEPT_FAILURES);
    }
}

/// Streams `shape` once, reading to the end: its stream id (when an event carried one)
/// and its record, or why it did not complete.
fn stream_once(api: &Api, shape: &Shape) -> (Option<String>, Result<Record, String>) {
    let mut reader = match api.try_stream_from(shape.path, &shape.body, None) {
        Ok(r) => r,
        Err(e) => return (None, Err(e)),
    };
    let events = reader.collect_all();
    let stream = events
        .iter()
        .find_map(|e| e.stream_id().map(str::to_string));
    (stream, record(&events))
}

/// The uninterrupted runs of every shape, one at a time.
fn references(api: &Api, shapes: &[Shape], tap: &TokenTap) -> Result<Vec<Reference>, String> {
    shapes
        .iter()
        .map(|shape| {
            let (_, outcome) = stream_once(api, shape);
            let run = outcome.map_err(|e| format!("reference run of {}: {e}", shape.label))?;
            let tapped = tap.take(&run.stream, TAP_WAIT);
            Reference::new(run, tapped).map_err(|e| format!("{}: {e}", shape.label))
        })
        .collect()
}

/// Runs the soak on `cluster`, which must have two workers (A and B).
pub fn run(cluster: &mut Cluster, options: &SoakOptions) -> SoakReport {
    let mut report = SoakReport::new(options);
    assert!(
        cluster.workers.len() > KILLED_SLOT,
        "a soak needs two workers"
    );
    let tap = match TokenTap::start(&cluster.nats.url) {
        Ok(t) => t,
        Err(e) => {
            report.problems.push(e);
            return report;
        }
    };
    let shapes = shapes(&cluster.model, options.max_tokens);
    let references = match references(&cluster.api, &shapes, &tap) {
        Ok(r) => r,
        Err(e) => {
            report.problems.push(e);
            return report;
        }
    };
    let clients = Clients {
        api: cluster.api.clone(),
        shapes: &shapes,
        references: &references,
        tap: &tap,
        next: AtomicUsize::new(0),
        stop: AtomicBool::new(false),
        report: Mutex::new((Tally::default(), Vec::new())),
    };
    let start = Instant::now();
    std::thread::scope(|scope| {
        for i in 0..options.concurrency {
            let clients = &clients;
            scope.spawn(move || {
                // Staggered, so that streams do not start and end in step.
                std::thread::sleep(Duration::from_millis(150 * i as u64));
                clients.run();
            });
        }
        // The clients stop when the clock does, even if it panics (a binary that
        // cannot be restarted, say): otherwise the scope would wait for them forever.
        struct StopOnDrop<'a>(&'a AtomicBool);
        impl Drop for StopOnDrop<'_> {
            fn drop(&mut self) {
                self.0.store(true, Ordering::Relaxed);
            }
        }
        let _stop = StopOnDrop(&clients.stop);
        drive(cluster, options, start, &mut report);
    });
    report.elapsed = start.elapsed();
    let (tally, failures) = clients
        .report
        .into_inner()
        .expect("no client thread panicked holding the report");
    report.tally = tally;
    report.failures = failures;
    report.resumes = resumes(&cluster.api);
    if tap.malformed() > 0 {
        report
            .problems
            .push(format!("{} token messages did not decode", tap.malformed()));
    }
    report
}

/// The run's clock: memory samples, kills and restarts of worker B, until the end.
fn drive(cluster: &mut Cluster, options: &SoakOptions, start: Instant, report: &mut SoakReport) {
    let end = start + options.duration;
    let mut next_sample = start + options.warmup();
    let mut next_kill = start + options.kill_every;
    let mut restart_at: Option<Instant> = None;
    // Worker A lives the whole run: its metrics address is read from its log once.
    let metrics = cluster
        .worker_metrics_addr(LIVE_SLOT)
        .map(|addr| format!("http://{addr}/metrics"));
    loop {
        let now = Instant::now();
        if now >= next_sample && now < end {
            report
                .samples
                .push(sample(cluster, metrics.as_deref(), start));
            next_sample += options.sample_every();
        }
        if restart_at.is_some_and(|t| now >= t) {
            cluster.restart_worker(KILLED_SLOT);
            restart_at = None;
        }
        if now >= next_kill && now < end {
            cluster.workers[KILLED_SLOT].kill();
            report.kills += 1;
            restart_at = Some(now + options.restart_after);
            next_kill += options.kill_every;
        }
        if let Some(status) = cluster.coordinator.try_status() {
            report
                .problems
                .push(format!("the coordinator exited ({status})"));
            return;
        }
        if let Some(status) = cluster.workers[LIVE_SLOT].try_status() {
            report.problems.push(format!("worker A exited ({status})"));
            return;
        }
        if now >= end && restart_at.is_none() {
            report
                .samples
                .push(sample(cluster, metrics.as_deref(), start));
            return;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Memory now; `metrics` is worker A's metrics URL.
fn sample(cluster: &mut Cluster, metrics: Option<&str>, start: Instant) -> RssSample {
    let coordinator = cluster
        .api
        .get("/metrics")
        .ok()
        .and_then(|r| r.body.as_str().map(str::to_string))
        .unwrap_or_default();
    RssSample {
        at: start.elapsed(),
        coordinator_kib: cluster.coordinator.rss_kib(),
        coordinator_anon_kib: cluster.coordinator.anon_kib(),
        worker_kib: cluster.workers[LIVE_SLOT].rss_kib(),
        worker_cache_kib: metrics.and_then(prefix_cache_kib),
        held_streams: gauge(&coordinator, "baton_streams_held"),
        store_streams: gauge(&coordinator, "baton_checkpoint_store_streams"),
    }
}

/// The value of the unlabelled gauge `name` in a metrics text.
fn gauge(text: &str, name: &str) -> Option<u64> {
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' '))
        .and_then(|v| v.trim().parse::<f64>().ok())
        .map(|v| v as u64)
}

/// `baton_worker_prefix_cache_bytes` at the metrics URL `url`, in KiB.
fn prefix_cache_kib(url: &str) -> Option<u64> {
    let text = reqwest::blocking::Client::builder()
        .timeout(Duration::from_secs(2))
        .build()
        .ok()?
        .get(url)
        .send()
        .and_then(|r| r.text())
        .ok()?;
    text.lines()
        .find_map(|l| l.strip_prefix("baton_worker_prefix_cache_bytes "))
        .and_then(|v| v.trim().parse::<f64>().ok())
        .map(|bytes| bytes as u64 / 1024)
}

/// The sum of `baton_stream_resumes_total` over its causes.
fn resumes(api: &Api) -> Option<u64> {
    let reply = api.get("/metrics").ok()?;
    let text = reply.body.as_str()?.to_string();
    let sum = text
        .lines()
        .filter(|l| l.starts_with("baton_stream_resumes_total"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum::<f64>();
    Some(sum as u64)
}
