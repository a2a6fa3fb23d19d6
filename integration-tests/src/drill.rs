//! Failover drills: break a running cluster mid-stream and check that every client still
//! gets exactly the text of an uninterrupted run.
//!
//! Each drill streams a chat completion (`stream: true`, usage included), breaks
//! something after a few tokens, reads the rest, and compares with a reference run of the
//! same request that nothing interrupted: the same text, finish reason and token count,
//! and event positions that only go up (none repeated). The *resume gap* is the time from
//! the break to the next token the client receives.
//!
//! - [`kill_worker`]: `kill -9` the worker serving the stream; a replacement starts.
//! - [`stop_worker`]: `SIGTERM` the worker serving the stream: it drains.
//! - [`restart_coordinator`]: `kill -9` the coordinator and start it again on the same
//!   store; the client reconnects with `Last-Event-ID`.
//! - [`lose_coordinator`]: `kill -9` the coordinator of several streams and delete its
//!   store; the clients reconnect to another coordinator, which has the checkpoints from
//!   JetStream.
//! - [`restart_nats`]: kill `nats-server` and start it again on the same port.
//! - [`kill_nats_member`]: on a cluster of several `nats-server`s, kill the one that
//!   carries the coordinator's connection, or the serving worker's, or neither; every
//!   process fails over to the servers left, and the killed one rejoins afterwards.
//!
//! `scripts/drill` runs them on the default model (`baton-drill`); the integration tests
//! run shortened versions.

use std::sync::mpsc;
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::http::SseEvent;
use crate::{Cluster, SseReader};

mod control;
mod swap;
pub use control::*;
pub use swap::*;

/// How tokens are picked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Sampling {
    /// Temperature 0.
    Greedy,
    /// Temperature 0.8, top-p 0.95, this seed.
    Seeded(u64),
}

impl Sampling {
    /// Sets the request's sampling fields.
    pub fn apply(self, body: &mut Value) {
        match self {
            Sampling::Greedy => body["temperature"] = json!(0),
            Sampling::Seeded(seed) => {
                body["temperature"] = json!(0.8);
                body["top_p"] = json!(0.95);
                body["seed"] = json!(seed);
            }
        }
    }

    /// A short name for verdict lines.
    pub fn name(self) -> String {
        match self {
            Sampling::Greedy => "greedy".into(),
            Sampling::Seeded(seed) => format!("seed {seed}"),
        }
    }
}

/// The result of one drill.
#[derive(Debug, Clone)]
pub struct Verdict {
    /// What was done.
    pub name: String,
    /// Streams broken.
    pub runs: usize,
    /// Streams that ended exactly as the reference did.
    pub passed: usize,
    /// Break → next token, per stream that got one.
    pub gaps: Vec<Duration>,
    /// What went wrong, per failed stream.
    pub failures: Vec<String>,
}

impl Verdict {
    /// A drill called `name` with nothing run yet.
    pub fn named(name: String) -> Verdict {
        Verdict {
            name,
            runs: 0,
            passed: 0,
            gaps: Vec::new(),
            failures: Vec::new(),
        }
    }

    /// Whether every stream passed and nothing else went wrong (a check after the
    /// streams: a server that did not rejoin, a refusal that did not come).
    pub fn ok(&self) -> bool {
        self.runs > 0 && self.passed == self.runs && self.failures.is_empty()
    }

    /// The `q`-quantile of the gaps (nearest rank).
    pub fn gap_quantile(&self, q: f64) -> Option<Duration> {
        let mut g = self.gaps.clone();
        if g.is_empty() {
            return None;
        }
        g.sort();
        let rank = ((q * g.len() as f64).ceil() as usize).clamp(1, g.len());
        Some(g[rank - 1])
    }

    /// One line: verdict, counts, resume gap p50 and p99.
    pub fn line(&self) -> String {
        let ms =
            |d: Option<Duration>| d.map_or("-".to_string(), |d| format!("{} ms", d.as_millis()));
        format!(
            "{} {}: {}/{} streams identical to an uninterrupted run; resume gap p50 {}, p99 {}",
            if self.ok() { "PASS" } else { "FAIL" },
            self.name,
            self.passed,
            self.runs,
            ms(self.gap_quantile(0.5)),
            ms(self.gap_quantile(0.99)),
        )
    }
}

/// What a client saw of one stream.
#[derive(Debug, Clone, Default)]
struct Seen {
    events: Vec<(Instant, SseEvent)>,
}

/// What a stream came to.
#[derive(Debug, Clone, PartialEq)]
struct Outcome {
    text: String,
    finish_reason: Option<String>,
    completion_tokens: Option<u64>,
    /// Every token's logprobs entry, in order (empty when not asked for).
    logprobs: Vec<Value>,
    /// The streamed tool-call deltas, in order, each without its `id` (named after the
    /// stream, so another in each run).
    tool_calls: Vec<Value>,
}

impl Seen {
    fn text_events(&self) -> usize {
        self.events
            .iter()
            .filter(|(_, e)| e.position().is_some() && !e.text().is_empty())
            .count()
    }

    fn last_id(&self) -> Option<String> {
        self.events.iter().rev().find_map(|(_, e)| e.id.clone())
    }

    fn stream_id(&self) -> Option<String> {
        self.events
            .iter()
            .find_map(|(_, e)| e.stream_id().map(str::to_string))
    }

    /// The first token after `t`.
    fn first_token_after(&self, t: Instant) -> Option<Instant> {
        self.events
            .iter()
            .find(|(at, e)| *at >= t && !e.text().is_empty())
            .map(|(at, _)| *at)
    }

    /// The outcome, or why the stream is not a clean one.
    fn outcome(&self) -> Result<Outcome, String> {
        let mut text = String::new();
        let mut finish_reason = None;
        let mut completion_tokens = None;
        let mut logprobs = Vec::new();
        let mut tool_calls = Vec::new();
        let mut done = false;
        let mut last: Option<u64> = None;
        for (_, e) in &self.events {
            if e.event.as_deref() == Some("error") {
                return Err(format!("error event: {}", e.data));
            }
            if e.is_done() {
                done = true;
                continue;
            }
            let p = e.text();
            if !p.is_empty() {
                let pos = e.position().ok_or("a text event without a position")?;
                if last.is_some_and(|l| pos <= l) {
                    return Err(format!(
                        "position {pos} after {last:?}: repeated or out of order"
                    ));
                }
                last = Some(pos);
                text.push_str(&p);
            }
            if let Some(json) = e.json() {
                for c in json["choices"].as_array().into_iter().flatten() {
                    if let Some(r) = c["finish_reason"].as_str() {
                        finish_reason = Some(r.to_string());
                    }
                    logprobs.extend(
                        c["logprobs"]["content"]
                            .as_array()
                            .into_iter()
                            .flatten()
                            .cloned(),
                    );
                    for call in c["delta"]["tool_calls"].as_array().into_iter().flatten() {
                        // A call's first delta names it; later ones carry arguments.
                        let mut call = call.clone();
                        if let Some(id) = call.get("id") {
                            if !id.as_str().is_some_and(|id| id.starts_with("call_")) {
                                return Err(format!("a tool call with a bad id: {call}"));
                            }
                            call["id"] = Value::Null;
                        }
                        tool_calls.push(call);
                    }
                }
                if let Some(n) = json["usage"]["completion_tokens"].as_u64() {
                    completion_tokens = Some(n);
                }
            }
        }
        if !done {
            return Err("no [DONE]".into());
        }
        Ok(Outcome {
            text,
            finish_reason,
            completion_tokens,
            logprobs,
            tool_calls,
        })
    }
}

/// Reads a stream on a thread, timestamping each event as it arrives.
struct Reader {
    rx: mpsc::Receiver<(Instant, SseEvent)>,
}

impl Reader {
    fn spawn(mut sse: SseReader) -> Reader {
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            while let Some(e) = sse.next_event() {
                let done = e.is_done();
                if tx.send((Instant::now(), e)).is_err() || done {
                    break;
                }
            }
        });
        Reader { rx }
    }

    /// Reads until `seen` has `n` text events (or the stream ends, or `timeout`).
    fn until(&self, seen: &mut Seen, n: usize, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        while seen.text_events() < n {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.rx.recv_timeout(left) {
                Ok(e) => seen.events.push(e),
                Err(_) => return false,
            }
        }
        true
    }

    /// Reads to the end of the body (or `timeout`).
    fn rest(self, seen: &mut Seen, timeout: Duration) {
        let deadline = Instant::now() + timeout;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.rx.recv_timeout(left) {
                Ok(e) => seen.events.push(e),
                Err(_) => return,
            }
        }
    }
}

const PATH: &str = "/v1/chat/completions";
const STREAM_TIMEOUT: Duration = Duration::from_secs(120);

/// The drills' request.
pub fn request(cluster: &Cluster, sampling: Sampling, max_tokens: u32, i: usize) -> Value {
    let mut body = json!({
        "model": cluster.model,
        "messages": [
            {"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": format!("Tell me a short story about a lighthouse keeper number {i}.")},
        ],
        "max_tokens": max_tokens,
        "stream": true,
        "stream_options": {"include_usage": true},
    });
    sampling.apply(&mut body);
    body
}

/// The JSON schema of the structured drills: a keeper and three to five records, which
/// the default model fills in about 120 tokens and then ends.
pub fn supplies_schema() -> Value {
    json!({
        "type": "object",
        "properties": {
            "keeper": {"type": "string", "maxLength": 24},
            "items": {
                "type": "array", "minItems": 3, "maxItems": 5,
                "items": {
                    "type": "object",
                    "properties": {
                        "name": {"type": "string", "maxLength": 20},
                        "count": {"type": "integer", "minimum": 1, "maximum": 99},
                        "fragile": {"type": "boolean"}
                    },
                    "required": ["name", "count", "fragile"],
                    "additionalProperties": false
                }
            }
        },
        "required": ["keeper", "items"],
        "additionalProperties": false
    })
}

/// The structured drills' request: the output held to [`supplies_schema`], with each
/// token's logprobs and two alternatives.
pub fn structured_request(
    cluster: &Cluster,
    sampling: Sampling,
    max_tokens: u32,
    i: usize,
) -> Value {
    let mut body = request(cluster, sampling, max_tokens, i);
    body["messages"][1]["content"] = json!(format!(
        "List the supplies of lighthouse keeper number {i} as JSON."
    ));
    body["response_format"] = json!({
        "type": "json_schema",
        "json_schema": {"name": "supplies", "schema": supplies_schema(), "strict": true}
    });
    // The resumed stream's logprobs are checked against the uninterrupted run's too.
    body["logprobs"] = json!(true);
    body["top_logprobs"] = json!(2);
    body
}

/// The tool-call drill's request: the supplies schema as the parameters of a function
/// the model must call, with each token's logprobs and two alternatives.
pub fn tool_call_request(cluster: &Cluster, sampling: Sampling, max_tokens: u32) -> Value {
    let mut body = structured_request(cluster, sampling, max_tokens, 0);
    body.as_object_mut()
        .expect("an object")
        .remove("response_format");
    body["messages"][1]["content"] = json!("Record the supplies of lighthouse keeper number 0.");
    body["tools"] = json!([{"type": "function", "function": {
        "name": "record_supplies",
        "description": "Records what a lighthouse keeper has in store.",
        "parameters": supplies_schema()}}]);
    body["tool_choice"] = json!({"type": "function", "function": {"name": "record_supplies"}});
    // One call, then the end (a small model offered more would go on calling).
    body["parallel_tool_calls"] = json!(false);
    body
}

/// The arguments of the one call of `outcome` (its deltas joined), or why it is not one
/// valid call.
fn one_call(outcome: &Outcome) -> Result<String, String> {
    let deltas = &outcome.tool_calls;
    let named = deltas
        .iter()
        .filter(|d| d["function"].get("name").is_some())
        .count();
    let args: String = deltas
        .iter()
        .map(|d| d["function"]["arguments"].as_str().unwrap_or_default())
        .collect();
    match deltas.first() {
        Some(first)
            if named == 1
                && first["function"]["name"] == "record_supplies"
                && deltas.iter().all(|d| d["index"] == 0) =>
        {
            match supplies_fault(&args) {
                None => Ok(args),
                Some(fault) => Err(fault),
            }
        }
        _ => Err(format!("not one call of record_supplies: {deltas:?}")),
    }
}

/// The worker's count of generated tokens, from its metrics endpoint.
fn generated_tokens(cluster: &Cluster, worker: usize) -> Option<u64> {
    let addr = cluster.worker_metrics_addr(worker)?;
    let text = reqwest::blocking::get(format!("http://{addr}/metrics"))
        .ok()?
        .text()
        .ok()?;
    text.lines()
        .find_map(|l| l.strip_prefix("baton_worker_generation_tokens_total "))
        .and_then(|v| v.trim().parse::<f64>().ok())
        .map(|v| v as u64)
}

/// `kill -9` the worker serving a stream that must call a function (its arguments held
/// to [`supplies_schema`] by the call's grammar), `runs` times, a quarter, a half or
/// three quarters of the way through the call. The break is timed by the worker's own
/// token count (a call's first text reaches the client only once its name is written),
/// and the coordinator's log says at which position the stream resumed. The resumed stream must give the uninterrupted run's
/// call, finish reason and every token's logprobs; the call itself validates.
pub fn kill_worker_tool_call(
    cluster: &mut Cluster,
    sampling: Sampling,
    runs: usize,
    max_tokens: u32,
) -> Verdict {
    let mut verdict = Verdict::named(format!(
        "kill -9 the serving worker ({}, tool call)",
        sampling.name()
    ));
    let live = live_workers(cluster);
    let body = tool_call_request(cluster, sampling, max_tokens);
    let Some(reference) = first_run(cluster, &body, &mut verdict, runs) else {
        return verdict;
    };
    let checks = one_call(&reference).and_then(|_| {
        match (&reference.finish_reason, reference.completion_tokens) {
            (Some(f), Some(n)) if f == "tool_calls" && n as usize == reference.logprobs.len() => {
                Ok(n)
            }
            other => Err(format!(
                "finish and logprobs: {other:?}, {} entries",
                reference.logprobs.len()
            )),
        }
    });
    let tokens = match checks {
        Ok(n) => n,
        Err(e) => {
            verdict.runs = runs;
            verdict.failures.push(format!("reference run: {e}"));
            return verdict;
        }
    };
    for i in 0..runs {
        let label = format!("run {i}");
        // A quarter, a half, three quarters of the way through the call.
        let break_at = tokens * (1 + i as u64 % 3) / 4;
        let before: Vec<Option<u64>> = (0..cluster.workers.len())
            .map(|w| generated_tokens(cluster, w))
            .collect();
        let accepted_before = cluster.coordinator.log().matches("stream accepted").count();
        let reader = Reader::spawn(cluster.api.stream(PATH, &body));
        let mut seen = Seen::default();
        // The worker that took the stream, and the moment it is that far through.
        let deadline = Instant::now() + STREAM_TIMEOUT;
        let mut serving = None;
        while Instant::now() < deadline {
            if serving.is_none() {
                let log = cluster.coordinator.log();
                serving = log
                    .lines()
                    .filter(|l| l.contains("stream accepted"))
                    .nth(accepted_before)
                    .and_then(|l| crate::cluster::field(l, "worker"))
                    .and_then(|id| {
                        (0..cluster.workers.len())
                            .find(|&i| cluster.worker_id(i).as_deref() == Some(id.as_str()))
                    });
            }
            if let Some(w) = serving {
                let now = generated_tokens(cluster, w).unwrap_or(0);
                if now >= before.get(w).copied().flatten().unwrap_or(0) + break_at {
                    break;
                }
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        verdict.runs += 1;
        let Some(w) = serving else {
            verdict
                .failures
                .push(format!("{label}: no worker took the stream"));
            continue;
        };
        // No resume gap is measured: the client sees nothing until the call is whole.
        cluster.workers[w].kill();
        cluster.add_worker();
        reader.rest(&mut seen, STREAM_TIMEOUT);
        // Where the second attempt took over: strictly inside the call.
        let stream = seen.stream_id().unwrap_or_default();
        let resumed_at = cluster
            .coordinator
            .log()
            .lines()
            .rfind(|l| {
                l.contains("stream accepted")
                    && crate::cluster::field(l, "stream").as_deref() == Some(stream.as_str())
                    && !l.contains("attempt=0")
            })
            .and_then(|l| crate::cluster::field(l, "position"))
            .and_then(|p| p.parse::<u64>().ok());
        match (seen.outcome(), resumed_at) {
            (Ok(o), Some(p)) if o == reference && p > 0 && p < tokens => verdict.passed += 1,
            (Ok(o), Some(p)) if o == reference => verdict.failures.push(format!(
                "{label}: the stream resumed at position {p} of {tokens}: not mid-call"
            )),
            (Ok(o), None) if o == reference => verdict.failures.push(format!(
                "{label}: no resumed attempt in the coordinator's log"
            )),
            (Ok(o), _) => verdict.failures.push(format!(
                "{label}: differs from the uninterrupted run:\n  got  {o:?}\n  want {reference:?}"
            )),
            (Err(e), _) => verdict.failures.push(format!("{label}: {e}")),
        }
        wait_workers(cluster, live);
    }
    verdict
}

/// Why `text` is not an instance of [`supplies_schema`], if it is not.
pub fn supplies_fault(text: &str) -> Option<String> {
    let value: Value = match serde_json::from_str(text) {
        Ok(v) => v,
        Err(e) => return Some(format!("not JSON ({e}): {text:?}")),
    };
    let validator = jsonschema::validator_for(&supplies_schema()).expect("a valid schema");
    let errors: Vec<String> = validator
        .iter_errors(&value)
        .map(|e| e.to_string())
        .collect();
    (!errors.is_empty()).then(|| format!("{text}: {}", errors.join("; ")))
}

/// One uninterrupted run.
fn reference(cluster: &Cluster, body: &Value) -> Result<Outcome, String> {
    let reader = Reader::spawn(cluster.api.stream(PATH, body));
    let mut seen = Seen::default();
    reader.rest(&mut seen, STREAM_TIMEOUT);
    seen.outcome().map_err(|e| format!("reference run: {e}"))
}

/// The uninterrupted run of `body` the drill's streams must match; `None` (the drill's
/// `runs` counted as failed, with why) when even it fails.
fn first_run(
    cluster: &Cluster,
    body: &Value,
    verdict: &mut Verdict,
    runs: usize,
) -> Option<Outcome> {
    match reference(cluster, body) {
        Ok(r) => Some(r),
        Err(e) => {
            verdict.runs = runs;
            verdict.failures.push(e);
            None
        }
    }
}

/// One more whole run of `body` after a drill (`when`) must match its first.
fn last_run(cluster: &Cluster, body: &Value, first: &Outcome, verdict: &mut Verdict, when: &str) {
    match reference(cluster, body) {
        Ok(o) if &o == first => {}
        Ok(o) => verdict.failures.push(format!(
            "{when}: differs from the first run:\n  got  {o:?}\n  want {first:?}"
        )),
        Err(e) => verdict.failures.push(format!("{when}: {e}")),
    }
}

/// Where in the stream to break it, for run `i`: early, middle, late.
fn break_after(i: usize, max_tokens: u32) -> usize {
    let span = (max_tokens as usize / 2).max(2);
    2 + (i * 7) % span
}

/// Starts `body`'s stream for run `i` and reads it up to its break; `None` (the run
/// counted as failed) when it ended before.
fn started(
    cluster: &Cluster,
    body: &Value,
    i: usize,
    max_tokens: u32,
    verdict: &mut Verdict,
    label: &str,
) -> Option<(Reader, Seen)> {
    let reader = Reader::spawn(cluster.api.stream(PATH, body));
    let mut seen = Seen::default();
    if reader.until(&mut seen, break_after(i, max_tokens), STREAM_TIMEOUT) {
        return Some((reader, seen));
    }
    verdict.runs += 1;
    verdict
        .failures
        .push(format!("{label}: the stream ended before the break"));
    None
}

/// How one broken stream went.
fn judge(verdict: &mut Verdict, seen: &Seen, reference: &Outcome, broke_at: Instant, label: &str) {
    verdict.runs += 1;
    if let Some(t) = seen.first_token_after(broke_at) {
        verdict.gaps.push(t - broke_at);
    }
    match seen.outcome() {
        Ok(o) if &o == reference => verdict.passed += 1,
        Ok(o) => verdict.failures.push(format!(
            "{label}: differs from the uninterrupted run:\n  got  {o:?}\n  want {reference:?}"
        )),
        Err(e) => verdict.failures.push(format!("{label}: {e}")),
    }
}

/// Finds the worker serving `stream` (the coordinator logs it), waiting a little.
fn serving_worker(cluster: &Cluster, stream: &str) -> Option<usize> {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        if let Some(w) = cluster.worker_of(stream) {
            return Some(w);
        }
        if Instant::now() > deadline {
            return None;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Breaks `runs` streams by stopping their worker — `kill -9` or `SIGTERM` — and starts
/// a replacement each time, so the cluster keeps its size.
fn worker_drill(
    cluster: &mut Cluster,
    sampling: Sampling,
    runs: usize,
    max_tokens: u32,
    hard: bool,
    structured: bool,
) -> Verdict {
    let name = format!(
        "{} the serving worker ({}{})",
        if hard { "kill -9" } else { "SIGTERM" },
        sampling.name(),
        if structured { ", json_schema" } else { "" }
    );
    let mut verdict = Verdict::named(name);
    let live = live_workers(cluster);
    let body = if structured {
        structured_request(cluster, sampling, max_tokens, 0)
    } else {
        request(cluster, sampling, max_tokens, 0)
    };
    let reference = match reference(cluster, &body) {
        // A structured stream's reference must itself be what its schema says (then so
        // is every resumed run that equals it).
        Ok(r) if structured && (r.finish_reason.as_deref() != Some("stop")) => {
            verdict.runs = runs;
            verdict.failures.push(format!(
                "reference run: finish_reason {:?}, not stop: {:?}",
                r.finish_reason, r.text
            ));
            return verdict;
        }
        // And it carries one logprobs entry per token, which every resumed run must equal.
        Ok(r) if structured && Some(r.logprobs.len() as u64) != r.completion_tokens => {
            verdict.runs = runs;
            verdict.failures.push(format!(
                "reference run: {} logprobs entries for {:?} tokens",
                r.logprobs.len(),
                r.completion_tokens
            ));
            return verdict;
        }
        Ok(r) if structured && supplies_fault(&r.text).is_some() => {
            verdict.runs = runs;
            verdict.failures.push(format!(
                "reference run: {}",
                supplies_fault(&r.text).unwrap_or_default()
            ));
            return verdict;
        }
        Ok(r) => r,
        Err(e) => {
            verdict.runs = runs;
            verdict.failures.push(e);
            return verdict;
        }
    };
    for i in 0..runs {
        let label = format!("run {i}");
        let Some((reader, mut seen)) = started(cluster, &body, i, max_tokens, &mut verdict, &label)
        else {
            continue;
        };
        let stream = seen.stream_id().unwrap_or_default();
        let Some(w) = serving_worker(cluster, &stream) else {
            verdict.runs += 1;
            verdict
                .failures
                .push(format!("{label}: no worker found for stream {stream}"));
            continue;
        };
        let broke_at = Instant::now();
        if hard {
            cluster.workers[w].kill();
        } else {
            cluster.workers[w].terminate();
        }
        // The replacement starts once the stream has moved on (or ended), so that its
        // model load does not compete with the resume being measured.
        let before = seen.text_events();
        reader.until(&mut seen, before + 1, STREAM_TIMEOUT);
        cluster.add_worker();
        reader.rest(&mut seen, STREAM_TIMEOUT);
        judge(&mut verdict, &seen, &reference, broke_at, &label);
        if !hard {
            let _ = cluster.workers[w].wait_timeout(Duration::from_secs(30));
        }
        wait_workers(cluster, live);
    }
    verdict
}

/// `kill -9` the worker serving a stream, `runs` times.
pub fn kill_worker(
    cluster: &mut Cluster,
    sampling: Sampling,
    runs: usize,
    max_tokens: u32,
) -> Verdict {
    worker_drill(cluster, sampling, runs, max_tokens, true, false)
}

/// `kill -9` the worker serving a stream held to a JSON schema ([`structured_request`]),
/// `runs` times: the resumed stream rebuilds the grammar's state from the tokens so far
/// and ends exactly as an uninterrupted run (text and every token's logprobs), which
/// itself validates.
pub fn kill_worker_structured(
    cluster: &mut Cluster,
    sampling: Sampling,
    runs: usize,
    max_tokens: u32,
) -> Verdict {
    worker_drill(cluster, sampling, runs, max_tokens, true, true)
}

/// `SIGTERM` the worker serving a stream, `runs` times.
pub fn stop_worker(
    cluster: &mut Cluster,
    sampling: Sampling,
    runs: usize,
    max_tokens: u32,
) -> Verdict {
    worker_drill(cluster, sampling, runs, max_tokens, false, false)
}

/// The workers whose process still runs.
fn live_workers(cluster: &mut Cluster) -> usize {
    cluster
        .workers
        .iter_mut()
        .filter_map(|w| w.try_status().is_none().then_some(()))
        .count()
}

/// Waits until the coordinator counts `n` live workers and none of the stopped ones.
fn wait_workers(cluster: &mut Cluster, n: usize) {
    let deadline = Instant::now() + Duration::from_secs(60);
    while Instant::now() < deadline {
        let counted = cluster
            .api
            .get("/health")
            .ok()
            .and_then(|r| r.body["workers"].as_u64())
            .unwrap_or(0);
        if counted == n as u64 {
            return;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    eprintln!(
        "drill: the coordinator never counted {n} workers: {:?}",
        cluster.api.get("/health").map(|r| r.body)
    );
}
