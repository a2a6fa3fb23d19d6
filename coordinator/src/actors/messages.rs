//! Messages between the HTTP front, the NATS listeners and the actors.

use actix::Message;
use baton_common::ids::WorkerId;
use baton_common::protocol::{Heartbeat, TokenBatch};

use super::registry::{HealthStatus, LiveWorker, ModelEntry};
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
#[rtype(result = "super::registry::ClusterView")]
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
