//! The worker's Prometheus metrics, served at `GET /metrics` on `worker.metrics_listen`.
//!
//! Load figures (running, queued, KV bytes, tokens) are read from the engine thread's
//! [`Load`] at each scrape; submit outcomes and cancels are counted by the actor.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use actix_web::{web, App, HttpResponse, HttpServer};
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

use super::scheduler::Load;

/// How a submitted sequence was answered.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct Outcome {
    /// `accepted`, or the refusal's kind (`overloaded`, `draining`, …).
    pub outcome: String,
}

/// Why a message on one of the worker's subjects was dropped.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct Dropped {
    /// The subject's role: `submit` or `cancel`.
    pub subject: String,
    /// `malformed` (did not decode) or `misplaced` (a kind that does not belong there).
    pub reason: String,
}

/// A model load or unload and how it went.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ModelOp {
    /// `load` or `unload`.
    pub op: String,
    /// `ok`, or the refusal's kind (`invalid_request`, `unknown_model`, …).
    pub outcome: String,
}

/// Every metric of a worker.
#[derive(Debug)]
pub struct WorkerMetrics {
    registry: Registry,
    load: Arc<Load>,
    /// Sequences submitted, by outcome.
    pub submitted: Family<Outcome, Counter>,
    /// Cancel requests received.
    pub cancels: Counter,
    /// Probes answered.
    pub probes: Counter,
    /// Messages dropped, by subject and reason.
    pub dropped: Family<Dropped, Counter>,
    /// Model loads and unloads, by outcome.
    pub model_ops: Family<ModelOp, Counter>,
    running: Gauge,
    retiring: Gauge,
    queued: Gauge,
    kv_used: Gauge,
    kv_budget: Gauge,
    tokens: Counter,
    prefix_hits: Counter,
    prefix_misses: Counter,
    prefix_reused_tokens: Counter,
    prefix_blocks: Gauge,
    prefix_bytes: Gauge,
}

impl WorkerMetrics {
    /// Metrics reading `load`; `kv_budget` is the configured budget in bytes.
    pub fn new(load: Arc<Load>, kv_budget: u64) -> Arc<Self> {
        let mut registry = Registry::with_prefix("baton_worker");
        let m = Self {
            registry: Registry::default(),
            load,
            submitted: Family::default(),
            cancels: Counter::default(),
            probes: Counter::default(),
            dropped: Family::default(),
            model_ops: Family::default(),
            running: Gauge::default(),
            retiring: Gauge::default(),
            queued: Gauge::default(),
            kv_used: Gauge::default(),
            kv_budget: Gauge::default(),
            tokens: Counter::default(),
            prefix_hits: Counter::default(),
            prefix_misses: Counter::default(),
            prefix_reused_tokens: Counter::default(),
            prefix_blocks: Gauge::default(),
            prefix_bytes: Gauge::default(),
        };
        m.kv_budget
            .set(i64::try_from(kv_budget).unwrap_or(i64::MAX));
        let r = &mut registry;
        r.register(
            "sequences_submitted",
            "Sequences submitted, by outcome",
            m.submitted.clone(),
        );
        r.register("cancels", "Cancel requests received", m.cancels.clone());
        r.register("probes", "Liveness probes answered", m.probes.clone());
        r.register(
            "dropped_messages",
            "Malformed or misplaced NATS messages dropped, by subject and reason",
            m.dropped.clone(),
        );
        r.register(
            "model_changes",
            "Model loads and unloads asked of this worker, by outcome",
            m.model_ops.clone(),
        );
        r.register(
            "retiring_sequences",
            "Sequences finishing on a model no longer served (replaced or unloaded)",
            m.retiring.clone(),
        );
        r.register(
            "running_sequences",
            "Sequences in the running batch",
            m.running.clone(),
        );
        r.register(
            "queued_sequences",
            "Sequences waiting for a slot",
            m.queued.clone(),
        );
        r.register("kv_used_bytes", "KV cache bytes in use", m.kv_used.clone());
        r.register("kv_budget_bytes", "KV cache budget", m.kv_budget.clone());
        r.register("generation_tokens", "Tokens generated", m.tokens.clone());
        r.register(
            "prefix_cache_hits",
            "Sequences that started from cached prefix positions",
            m.prefix_hits.clone(),
        );
        r.register(
            "prefix_cache_misses",
            "Sequences that found none of their prompt cached",
            m.prefix_misses.clone(),
        );
        r.register(
            "prefix_cache_reused_tokens",
            "Prompt tokens whose KV came from the prefix cache",
            m.prefix_reused_tokens.clone(),
        );
        r.register(
            "prefix_cache_blocks",
            "Blocks the prefix cache holds",
            m.prefix_blocks.clone(),
        );
        r.register(
            "prefix_cache_bytes",
            "Bytes of keys and values the prefix cache holds",
            m.prefix_bytes.clone(),
        );
        Arc::new(Self { registry, ..m })
    }

    /// Counts one submitted sequence's outcome.
    pub fn submitted(&self, outcome: &str) {
        self.submitted
            .get_or_create(&Outcome {
                outcome: outcome.to_string(),
            })
            .inc();
    }

    /// Counts one model load or unload.
    pub fn model_op(&self, op: &str, outcome: &str) {
        self.model_ops
            .get_or_create(&ModelOp {
                op: op.to_string(),
                outcome: outcome.to_string(),
            })
            .inc();
    }

    /// Counts one message dropped from `subject` for `reason`.
    pub fn dropped(&self, subject: &str, reason: &str) {
        self.dropped
            .get_or_create(&Dropped {
                subject: subject.to_string(),
                reason: reason.to_string(),
            })
            .inc();
    }

    /// The text exposition, with the load figures read now.
    pub fn encode(&self) -> String {
        let read = |a: &std::sync::atomic::AtomicU64| {
            i64::try_from(a.load(Ordering::Relaxed)).unwrap_or(i64::MAX)
        };
        self.running.set(read(&self.load.running));
        self.queued.set(read(&self.load.queued));
        self.retiring.set(read(&self.load.retiring_streams));
        self.kv_used.set(read(&self.load.kv_bytes));
        for (metric, source) in [
            (&self.tokens, &self.load.tokens),
            (&self.prefix_hits, &self.load.prefix_hits),
            (&self.prefix_misses, &self.load.prefix_misses),
            (&self.prefix_reused_tokens, &self.load.prefix_reused_tokens),
        ] {
            let now = source.load(Ordering::Relaxed);
            let seen = metric.get();
            if now > seen {
                metric.inc_by(now - seen);
            }
        }
        self.prefix_blocks.set(read(&self.load.prefix_blocks));
        self.prefix_bytes.set(read(&self.load.prefix_bytes));
        let mut out = String::new();
        if prometheus_client::encoding::text::encode(&mut out, &self.registry).is_err() {
            out.clear();
        }
        out
    }
}

async fn scrape(metrics: web::Data<Arc<WorkerMetrics>>) -> HttpResponse {
    HttpResponse::Ok()
        .content_type("text/plain; version=0.0.4; charset=utf-8")
        .body(metrics.encode())
}

/// Serves `GET /metrics` on `addr` (inside the running actix system); returns the bound
/// address. An empty `addr` serves nothing.
pub fn serve(
    addr: &str,
    metrics: Arc<WorkerMetrics>,
) -> std::io::Result<Option<std::net::SocketAddr>> {
    if addr.is_empty() {
        return Ok(None);
    }
    let data = web::Data::new(metrics);
    let server = HttpServer::new(move || {
        App::new()
            .app_data(data.clone())
            .route("/metrics", web::get().to(scrape))
    })
    .workers(1)
    .disable_signals()
    .bind(addr)?;
    let bound = server.addrs().first().copied();
    actix_rt::spawn(server.run());
    Ok(bound)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn load_figures_are_read_at_scrape_time() {
        let load = Arc::new(Load::default());
        let m = WorkerMetrics::new(load.clone(), 1 << 20);
        load.running.store(3, Ordering::Relaxed);
        load.tokens.store(42, Ordering::Relaxed);
        m.submitted("accepted");
        m.dropped("submit", "malformed");
        m.dropped("submit", "malformed");
        let text = m.encode();
        assert!(
            text.contains(
                "baton_worker_dropped_messages_total{subject=\"submit\",reason=\"malformed\"} 2"
            ),
            "{text}"
        );
        assert!(text.contains("baton_worker_running_sequences 3"), "{text}");
        assert!(
            text.contains("baton_worker_generation_tokens_total 42"),
            "{text}"
        );
        assert!(
            text.contains("baton_worker_kv_budget_bytes 1048576"),
            "{text}"
        );
        assert!(
            text.contains(r#"baton_worker_sequences_submitted_total{outcome="accepted"} 1"#),
            "{text}"
        );
        load.tokens.store(50, Ordering::Relaxed);
        assert!(m
            .encode()
            .contains("baton_worker_generation_tokens_total 50"));
    }
}
