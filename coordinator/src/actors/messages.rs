//! Messages between the HTTP front, the NATS listeners and the actors.

use std::time::Duration;

use actix::{Message, MessageResponse};
use baton_common::ids::WorkerId;
use baton_common::protocol::{Heartbeat, TokenBatch};

use super::router::RouteError;

/// A worker's heartbeat arrived (registry).
#[derive(Debug, Message)]
#[rtype(result = "()")]
pub struct WorkerHeartbeat {
    /// What the worker says about itself.
    pub heartbeat: Heartbeat,
}

/// Pick a worker for a new stream of `model` (registry). The chosen worker's in-flight
/// count goes up at once, so that concurrent requests spread between heartbeats; the
/// caller sends [`ReleaseWorker`] when the stream ends.
#[derive(Debug, Message)]
#[rtype(result = "Result<WorkerId, RouteError>")]
pub struct RouteStream {
    /// The model the client asked for.
    pub model: String,
    /// Workers not to pick (they already refused this request).
    pub exclude: Vec<WorkerId>,
    /// One entry per stream that goes to the chosen worker (a batch has several): its
    /// prompt's prefix keys ([`super::affinity::prefix_keys`]), empty when unknown.
    pub prefixes: Vec<Vec<u64>>,
}

/// A stream routed by [`RouteStream`] is over (registry).
#[derive(Debug, Message)]
#[rtype(result = "()")]
pub struct ReleaseWorker {
    /// The worker the stream ran on.
    pub worker: WorkerId,
}

/// The models live workers serve now (registry).
#[derive(Debug, Message)]
#[rtype(result = "Vec<ModelEntry>")]
pub struct ListModels;

/// Every live worker and its load (registry).
#[derive(Debug, Message)]
#[rtype(result = "ClusterView")]
pub struct ClusterStatus;

/// Every live worker, with its last heartbeat (registry).
#[derive(Debug, Message)]
#[rtype(result = "Vec<LiveWorker>")]
pub struct ListWorkers;

/// Whether the cluster can serve (registry).
#[derive(Debug, Message)]
#[rtype(result = "HealthStatus")]
pub struct CheckHealth;

/// Forget a worker at once (registry): a probe found it gone. Its streams are told
/// through [`WorkerLost`].
#[derive(Debug, Message)]
#[rtype(result = "()")]
pub struct ForgetWorker {
    /// The worker.
    pub worker: WorkerId,
}

/// One or more worker messages of decode steps (sessions), in arrival order.
#[derive(Debug, Message)]
#[rtype(result = "()")]
pub struct DispatchTokens {
    /// The batches.
    pub batches: Vec<TokenBatch>,
}

/// A worker left the registry (silent too long, or gone): its streams move (sessions).
#[derive(Debug, Clone, Message)]
#[rtype(result = "()")]
pub struct WorkerLost {
    /// The worker.
    pub worker: WorkerId,
}

// What the registry answers.

/// A model as `GET /v1/models` lists it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModelEntry {
    /// The name clients ask for.
    pub id: String,
    /// When this coordinator first saw it served (Unix seconds).
    pub created: u64,
    /// Longest sequence any live worker allows for it.
    pub context_length: u32,
}

/// A live worker as the NATS admin status shows it.
#[derive(Debug, Clone, PartialEq)]
pub struct LiveWorker {
    /// Its last heartbeat.
    pub heartbeat: Heartbeat,
    /// Time since that heartbeat.
    pub silent_for: Duration,
    /// Streams this coordinator runs on it.
    pub in_flight: u32,
}

/// Whether the cluster can serve.
#[derive(Debug, Clone, Copy, PartialEq, Eq, MessageResponse)]
pub enum HealthStatus {
    /// No heartbeat has ever arrived.
    NotSynced,
    /// Workers were seen, none is alive now.
    NoLiveWorkers,
    /// Some workers are alive.
    Live {
        /// How many.
        workers: usize,
    },
}

/// One live worker, for status pages and metrics.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct WorkerView {
    /// Its id.
    #[serde(serialize_with = "display")]
    pub id: WorkerId,
    /// Models it serves.
    pub models: Vec<String>,
    /// Most sequences it runs at once.
    pub capacity: u32,
    /// Sequences running (last heartbeat).
    pub running: u32,
    /// Sequences queued (last heartbeat).
    pub queued: u32,
    /// This coordinator's streams on it now.
    pub in_flight: u32,
    /// KV cache bytes in use.
    pub kv_used_bytes: u64,
    /// KV cache budget.
    pub kv_budget_bytes: u64,
    /// Taking no new work.
    pub draining: bool,
    /// Its software version.
    pub version: String,
    /// Milliseconds since its last heartbeat.
    pub last_seen_ms: u64,
}

fn display<S: serde::Serializer>(id: &WorkerId, s: S) -> Result<S::Ok, S::Error> {
    s.collect_str(id)
}

/// The cluster as the registry sees it.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, MessageResponse)]
pub struct ClusterView {
    /// Whether any heartbeat ever arrived.
    pub synced: bool,
    /// Live workers.
    pub workers: Vec<WorkerView>,
}
