//! Prometheus metrics of the coordinator, served at `GET /metrics` (text format).
//!
//! Names follow vLLM's and Dynamo's: a `baton_` prefix, seconds for durations, `_total`
//! for counters. Request outcomes and latencies are measured where the client sees them
//! (the HTTP handlers and the SSE body); failover and wire counters where they happen.
//! Gauges of the cluster (live workers, their load) are refreshed from the registry at
//! each scrape.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

use crate::actors::registry::WorkerView;
use crate::nats::Counters;

/// A request's endpoint and how it ended.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct Outcome {
    /// `chat` or `completion` (or `other`).
    pub endpoint: String,
    /// `finished`, `client_gone`, or the error code (`invalid_value`, `overloaded`, …).
    pub outcome: String,
}

/// Why a stream moved.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct Reason {
    /// The cause, as the sessions log it.
    pub reason: String,
}

/// Why the API key check refused a request.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct Refusal {
    /// `invalid_api_key` (401) or `insufficient_permissions` (403).
    pub code: String,
}

/// One worker.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct WorkerLabel {
    /// The worker's id.
    pub worker: String,
    /// The model it serves.
    pub model: String,
}

/// Every metric of the coordinator.
#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    /// Requests by endpoint and outcome.
    pub requests: Family<Outcome, Counter>,
    /// Request written → first token sent.
    pub time_to_first_token: Histogram,
    /// Between two tokens of one stream, as sent.
    pub inter_token_latency: Histogram,
    /// Request → last byte.
    pub e2e_latency: Histogram,
    /// Streams with a client attached now.
    pub streams_in_flight: Gauge,
    /// Streams the sessions hold now (running, resuming, or detached and waiting for a
    /// client to come back): `max_streams` bounds the first two, `max_detached_streams`
    /// the last.
    pub streams_held: Gauge,
    /// Streams in the checkpoint store at its last collection (every 30 s): the held
    /// ones and the ended ones kept for `reconnect_window_s`.
    pub store_streams: Gauge,
    /// Tokens sent to clients.
    pub tokens: Counter,
    /// Streams moved to another worker, by cause.
    pub resumes: Family<Reason, Counter>,
    /// Clients that reattached with `Last-Event-ID`.
    pub reattached: Counter,
    /// Streams of dead coordinators this one took over (from JetStream).
    pub taken_over: Counter,
    /// Checkpoint flushes (write + sync) and how long they took.
    pub checkpoint_flush: Histogram,
    /// Malformed or misplaced messages dropped.
    pub wire_malformed: Counter,
    /// Token messages lost (envelope sequence gaps).
    pub wire_missed: Counter,
    /// Requests on the public NATS subjects.
    pub public_requests: Counter,
    /// Malformed requests on the public NATS subjects, answered with an error.
    pub public_malformed: Counter,
    /// Requests the API key check refused, by code.
    pub auth_refusals: Family<Refusal, Counter>,
    /// Live workers.
    pub workers_live: Gauge,
    /// Sequences running on each worker (its last heartbeat).
    pub worker_running: Family<WorkerLabel, Gauge>,
    /// Sequences queued on each worker.
    pub worker_queued: Family<WorkerLabel, Gauge>,
    /// KV cache bytes in use on each worker.
    pub worker_kv_used_bytes: Family<WorkerLabel, Gauge>,
    /// KV cache budget of each worker.
    pub worker_kv_budget_bytes: Family<WorkerLabel, Gauge>,
    /// Tokens per second, one sample a second, for the status page.
    history: Mutex<VecDeque<(u64, f64)>>,
    /// The token counter at the last sample.
    sampled: AtomicU64,
}

/// Samples kept for the status page's chart: five minutes.
pub const HISTORY_SECONDS: usize = 300;

/// Buckets for latencies in seconds: 1 ms to ~65 s.
fn latency_buckets() -> impl Iterator<Item = f64> {
    prometheus_client::metrics::histogram::exponential_buckets(0.001, 2.0, 17)
}

impl Metrics {
    /// Every metric, registered.
    pub fn new() -> Arc<Self> {
        let mut registry = Registry::with_prefix("baton");
        let m = Self {
            requests: Family::default(),
            time_to_first_token: Histogram::new(latency_buckets()),
            inter_token_latency: Histogram::new(latency_buckets()),
            e2e_latency: Histogram::new(latency_buckets()),
            streams_in_flight: Gauge::default(),
            streams_held: Gauge::default(),
            store_streams: Gauge::default(),
            tokens: Counter::default(),
            resumes: Family::default(),
            reattached: Counter::default(),
            taken_over: Counter::default(),
            checkpoint_flush: Histogram::new(latency_buckets()),
            wire_malformed: Counter::default(),
            wire_missed: Counter::default(),
            public_requests: Counter::default(),
            public_malformed: Counter::default(),
            auth_refusals: Family::default(),
            workers_live: Gauge::default(),
            worker_running: Family::default(),
            worker_queued: Family::default(),
            worker_kv_used_bytes: Family::default(),
            worker_kv_budget_bytes: Family::default(),
            registry: Registry::default(),
            history: Mutex::new(VecDeque::with_capacity(HISTORY_SECONDS)),
            sampled: AtomicU64::new(0),
        };
        let r = &mut registry;
        r.register(
            "requests",
            "Requests by endpoint and outcome",
            m.requests.clone(),
        );
        r.register(
            "time_to_first_token_seconds",
            "Request received to first token sent",
            m.time_to_first_token.clone(),
        );
        r.register(
            "inter_token_latency_seconds",
            "Time between two tokens of a stream, as sent",
            m.inter_token_latency.clone(),
        );
        r.register(
            "e2e_request_latency_seconds",
            "Request received to its last token or error",
            m.e2e_latency.clone(),
        );
        r.register(
            "streams_in_flight",
            "Streams with a client attached",
            m.streams_in_flight.clone(),
        );
        r.register(
            "streams_held",
            "Streams the coordinator holds (running, resuming, detached)",
            m.streams_held.clone(),
        );
        r.register(
            "checkpoint_store_streams",
            "Streams in the checkpoint store at its last collection",
            m.store_streams.clone(),
        );
        r.register(
            "generation_tokens",
            "Tokens sent to clients",
            m.tokens.clone(),
        );
        r.register(
            "stream_resumes",
            "Streams moved to another worker, by cause",
            m.resumes.clone(),
        );
        r.register(
            "stream_reattaches",
            "Clients that reattached to a stream with Last-Event-ID",
            m.reattached.clone(),
        );
        r.register(
            "streams_taken_over",
            "Streams of dead coordinators taken over from JetStream",
            m.taken_over.clone(),
        );
        r.register(
            "checkpoint_flush_seconds",
            "Checkpoint store flushes (write and sync)",
            m.checkpoint_flush.clone(),
        );
        r.register(
            "wire_malformed_messages",
            "Malformed or misplaced NATS messages dropped",
            m.wire_malformed.clone(),
        );
        r.register(
            "wire_missed_messages",
            "Token messages lost (sequence gaps)",
            m.wire_missed.clone(),
        );
        r.register(
            "public_requests",
            "Requests on the public NATS subjects",
            m.public_requests.clone(),
        );
        r.register(
            "public_malformed_requests",
            "Malformed requests on the public NATS subjects",
            m.public_malformed.clone(),
        );
        r.register(
            "http_auth_refusals",
            "Requests refused by the API key check, by code",
            m.auth_refusals.clone(),
        );
        r.register("workers_live", "Live workers", m.workers_live.clone());
        r.register(
            "worker_running_sequences",
            "Sequences running on a worker",
            m.worker_running.clone(),
        );
        r.register(
            "worker_queued_sequences",
            "Sequences waiting on a worker",
            m.worker_queued.clone(),
        );
        r.register(
            "worker_kv_used_bytes",
            "KV cache bytes in use on a worker",
            m.worker_kv_used_bytes.clone(),
        );
        r.register(
            "worker_kv_budget_bytes",
            "KV cache budget of a worker",
            m.worker_kv_budget_bytes.clone(),
        );
        Arc::new(Self { registry, ..m })
    }

    /// Counts a request's end.
    pub fn request_done(&self, endpoint: &str, outcome: &str) {
        self.requests
            .get_or_create(&Outcome {
                endpoint: endpoint.to_string(),
                outcome: outcome.to_string(),
            })
            .inc();
    }

    /// Counts a request the API key check refused.
    pub fn auth_refused(&self, code: &str) {
        self.auth_refusals
            .get_or_create(&Refusal {
                code: code.to_string(),
            })
            .inc();
    }

    /// Counts a resume.
    pub fn resumed(&self, reason: &str) {
        self.resumes
            .get_or_create(&Reason {
                reason: reason.to_string(),
            })
            .inc();
    }

    /// Brings the wire counters up to `counters`.
    pub fn sync_wire(&self, counters: &Counters) {
        let catch_up = |metric: &Counter, now: u64| {
            let seen = metric.get();
            if now > seen {
                metric.inc_by(now - seen);
            }
        };
        catch_up(&self.wire_malformed, counters.garbage());
        catch_up(&self.wire_missed, counters.missed());
    }

    /// Sets the per-worker gauges to `workers`, the live ones: the label sets of
    /// workers that left go (each restarted worker has a new id, so they would
    /// otherwise pile up).
    pub fn set_workers(&self, workers: &[WorkerView]) {
        self.workers_live.set(workers.len() as i64);
        self.worker_running.clear();
        self.worker_queued.clear();
        self.worker_kv_used_bytes.clear();
        self.worker_kv_budget_bytes.clear();
        for w in workers {
            let label = WorkerLabel {
                worker: w.id.to_string(),
                model: w.models.join(","),
            };
            self.worker_running
                .get_or_create(&label)
                .set(i64::from(w.running));
            self.worker_queued
                .get_or_create(&label)
                .set(i64::from(w.queued));
            let bytes = |b: u64| i64::try_from(b).unwrap_or(i64::MAX);
            self.worker_kv_used_bytes
                .get_or_create(&label)
                .set(bytes(w.kv_used_bytes));
            self.worker_kv_budget_bytes
                .get_or_create(&label)
                .set(bytes(w.kv_budget_bytes));
        }
    }

    /// Records the tokens sent since the last call, `elapsed` seconds ago, at `unix`.
    pub fn sample(&self, unix: u64, elapsed: f64) {
        let now = self.tokens.get();
        let before = self.sampled.swap(now, Ordering::Relaxed);
        let rate = now.saturating_sub(before) as f64 / elapsed.max(1e-3);
        let mut h = self
            .history
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if h.len() == HISTORY_SECONDS {
            h.pop_front();
        }
        h.push_back((unix, rate));
    }

    /// Tokens per second over the last minutes: `(unix seconds, rate)`, oldest first.
    pub fn history(&self) -> Vec<(u64, f64)> {
        self.history
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .iter()
            .copied()
            .collect()
    }

    /// Brings the public API's counters up to `requests` and `malformed`.
    pub fn sync_public(&self, requests: u64, malformed: u64) {
        for (metric, now) in [
            (&self.public_requests, requests),
            (&self.public_malformed, malformed),
        ] {
            let seen = metric.get();
            if now > seen {
                metric.inc_by(now - seen);
            }
        }
    }

    /// The text exposition of every metric.
    pub fn encode(&self) -> String {
        let mut out = String::new();
        if prometheus_client::encoding::text::encode(&mut out, &self.registry).is_err() {
            out.clear();
        }
        out
    }
}

/// Measures one client's stream: time to first token, inter-token gaps, end-to-end
/// latency and outcome; counts it in flight while it lives.
#[derive(Debug)]
pub struct StreamTracker {
    metrics: Arc<Metrics>,
    endpoint: &'static str,
    started: std::time::Instant,
    last: Option<std::time::Instant>,
    done: bool,
}

impl StreamTracker {
    /// A stream of `endpoint` whose request arrived at `started`.
    pub fn new(metrics: Arc<Metrics>, endpoint: &'static str, started: std::time::Instant) -> Self {
        metrics.streams_in_flight.inc();
        Self {
            metrics,
            endpoint,
            started,
            last: None,
            done: false,
        }
    }

    /// A token went out.
    pub fn token(&mut self) {
        let now = std::time::Instant::now();
        match self.last {
            None => self
                .metrics
                .time_to_first_token
                .observe((now - self.started).as_secs_f64()),
            Some(last) => self
                .metrics
                .inter_token_latency
                .observe((now - last).as_secs_f64()),
        }
        self.last = Some(now);
        self.metrics.tokens.inc();
    }

    /// The stream ended: `finished`, or an error code.
    pub fn finish(&mut self, outcome: &str) {
        if !self.done {
            self.done = true;
            self.metrics
                .e2e_latency
                .observe(self.started.elapsed().as_secs_f64());
            self.metrics.request_done(self.endpoint, outcome);
        }
    }
}

impl Drop for StreamTracker {
    fn drop(&mut self) {
        self.finish("client_gone");
        self.metrics.streams_in_flight.dec();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn metrics_encode_with_prefix_and_labels() {
        let m = Metrics::new();
        m.request_done("chat", "finished");
        m.request_done("chat", "finished");
        m.time_to_first_token.observe(0.02);
        m.resumed("no responders");
        let counters = Counters::default();
        counters
            .garbage
            .fetch_add(3, std::sync::atomic::Ordering::Relaxed);
        m.sync_wire(&counters);
        m.sync_wire(&counters);
        let text = m.encode();
        assert!(
            text.contains(r#"baton_requests_total{endpoint="chat",outcome="finished"} 2"#),
            "{text}"
        );
        assert!(
            text.contains("baton_time_to_first_token_seconds_count 1"),
            "{text}"
        );
        assert!(text.contains(r#"baton_stream_resumes_total{reason="no responders"} 1"#));
        assert!(
            text.contains("baton_wire_malformed_messages_total 3"),
            "{text}"
        );
    }

    fn worker(id: u128) -> WorkerView {
        WorkerView {
            id: baton_common::ids::WorkerId(id),
            models: vec!["m".into()],
            capacity: 4,
            running: 1,
            queued: 0,
            in_flight: 1,
            kv_used_bytes: 10,
            kv_budget_bytes: 100,
            draining: false,
            version: "v".into(),
            last_seen_ms: 0,
        }
    }

    #[test]
    fn workers_that_left_lose_their_label_sets() {
        let m = Metrics::new();
        let (a, b) = (worker(1), worker(2));
        m.set_workers(&[a.clone(), b.clone()]);
        let text = m.encode();
        assert!(text.contains(&format!("worker=\"{}\"", b.id)), "{text}");
        // Worker B is killed; a new B (another id) joins.
        let c = worker(3);
        m.set_workers(&[a.clone(), c.clone()]);
        let text = m.encode();
        assert!(!text.contains(&format!("worker=\"{}\"", b.id)), "{text}");
        assert_eq!(
            text.matches("baton_worker_running_sequences{").count(),
            2,
            "{text}"
        );
        assert!(text.contains("baton_workers_live 2"), "{text}");
    }
}
