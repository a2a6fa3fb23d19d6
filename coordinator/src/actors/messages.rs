//! Messages between the HTTP front, the NATS listeners and the actors.

use actix::Message;
use baton_common::ids::{StreamId, WorkerId};
use baton_common::protocol::{EventKind, Heartbeat, TokenBatch};
use tokio::sync::mpsc::UnboundedSender;

use super::registry::{HealthStatus, ModelEntry};
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

/// Whether the cluster can serve (registry).
#[derive(Debug, Message)]
#[rtype(result = "HealthStatus")]
pub struct CheckHealth;

/// Open a stream session: its events go to `events` (sessions). Sent before the submit,
/// since tokens may arrive before the worker's reply.
#[derive(Debug, Message)]
#[rtype(result = "()")]
pub struct OpenSession {
    /// The stream.
    pub stream: StreamId,
    /// The worker it is submitted to (where a cancel goes).
    pub worker: WorkerId,
    /// Where its events go.
    pub events: UnboundedSender<EventKind>,
}

/// Close a stream session (sessions).
#[derive(Debug, Message)]
#[rtype(result = "()")]
pub struct CloseSession {
    /// The stream.
    pub stream: StreamId,
    /// The stream did not end on the worker: tell the worker to stop it.
    pub cancel: bool,
}

/// One decode step's events from a worker (sessions).
#[derive(Debug, Message)]
#[rtype(result = "()")]
pub struct DispatchTokens {
    /// The events.
    pub batch: TokenBatch,
}

/// A worker left the registry (silent too long): its streams fail (sessions).
#[derive(Debug, Clone, Message)]
#[rtype(result = "()")]
pub struct WorkerLost {
    /// The worker.
    pub worker: WorkerId,
}
