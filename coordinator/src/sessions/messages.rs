//! The messages the sessions actor takes from the fronts.

use actix::Message;
use baton_common::ids::StreamId;
use tokio::sync::mpsc::UnboundedSender;
use tokio::sync::oneshot;

use super::session::Update;
use crate::auth::StreamAccess;
use crate::dispatch::DispatchError;
use crate::store::StreamRecord;

/// Start a new stream (sessions): subscribe `subscriber`, dispatch once, and answer on
/// the returned channel whether a worker took it.
#[derive(Debug, Message)]
#[rtype(result = "oneshot::Receiver<Result<u32, DispatchError>>")]
pub struct StartStream {
    /// The stream's id.
    pub stream: StreamId,
    /// Its request and shape.
    pub record: StreamRecord,
    /// Where its updates go.
    pub subscriber: UnboundedSender<Update>,
}

/// What an attached client needs to render a stream.
#[derive(Debug, Clone)]
pub struct Attached {
    /// The stream's record (shape, model, created).
    pub record: StreamRecord,
    /// Prompt tokens, when known.
    pub prompt_tokens: u32,
}

/// Why a client cannot attach.
#[derive(Debug, thiserror::Error)]
pub enum AttachError {
    /// No such stream here (never, or collected).
    #[error("no stream {0} on this coordinator (unknown, or past the reconnect window)")]
    Unknown(StreamId),
    /// The client's chain hash at its last position is not the stream's.
    #[error("stream {0} has another text than the client's at position {1} (chain hash differs)")]
    Diverged(StreamId, u32),
    /// The store failed.
    #[error("{0}")]
    Store(String),
    /// The shared checkpoints did not answer in time (the client may retry).
    #[error("{0}")]
    Unavailable(String),
}

/// Attach a client to a stream (sessions): replay after `after`, then live updates.
/// A stream this coordinator does not hold is looked up in JetStream, when checkpoints
/// go there: taken over if its coordinator is dead, else followed as it is written.
#[derive(Debug, Clone, Message)]
#[rtype(result = "Result<Attached, AttachError>")]
pub struct Attach {
    /// The stream.
    pub stream: StreamId,
    /// Last position the client has (`None`: from the start).
    pub after: Option<u32>,
    /// The chain hash the client holds at `after`, when it says: checked against the
    /// stream's, now or when the stream gets there again.
    pub after_hash: Option<u64>,
    /// Where its updates go.
    pub subscriber: UnboundedSender<Update>,
    /// Which streams the client may read; any other is [`AttachError::Unknown`].
    pub access: StreamAccess,
}

/// Take over a stream of a dead coordinator (sessions), claimed in JetStream.
#[derive(Debug, Message)]
#[rtype(result = "()")]
pub struct Adopt(pub crate::replica::Claimed);

/// A client's channel closed (sessions): when no client is left, the worker stops.
#[derive(Debug, Message)]
#[rtype(result = "()")]
pub struct Detach {
    /// The stream.
    pub stream: StreamId,
}
