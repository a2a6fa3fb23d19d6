//! Stream sessions: where each stream's events go.
//!
//! The HTTP handler of a stream opens a session (a channel) before it submits, the
//! token listener dispatches every worker event to its stream's channel, and the handler
//! closes the session when it is done — with a cancel to the worker when the client went
//! away first. [`SessionTable`] is the logic (tested without actors); [`Sessions`] is
//! the actor around it, which also publishes the cancels.

use std::collections::HashMap;

use actix::{Actor, Addr, Context, Handler};
use baton_common::ids::{StreamId, WorkerId};
use baton_common::protocol::{ErrorKind, EventKind, TokenBatch, WireError};
use tokio::sync::mpsc::UnboundedSender;
use tracing::{debug, warn};

use super::messages::{CloseSession, DispatchTokens, OpenSession, ReleaseWorker, WorkerLost};
use super::registry::Registry;
use crate::nats::NatsHandle;

/// One open stream.
#[derive(Debug)]
struct Session {
    /// The worker running it.
    worker: WorkerId,
    /// Its handler's channel.
    events: UnboundedSender<EventKind>,
}

/// Open streams by id.
#[derive(Debug, Default)]
pub struct SessionTable {
    sessions: HashMap<StreamId, Session>,
}

impl SessionTable {
    /// Opens (or replaces) the session of `stream`.
    pub fn open(&mut self, stream: StreamId, worker: WorkerId, events: UnboundedSender<EventKind>) {
        self.sessions.insert(stream, Session { worker, events });
    }

    /// Closes the session of `stream`; returns its worker if it was still open.
    pub fn close(&mut self, stream: StreamId) -> Option<WorkerId> {
        self.sessions.remove(&stream).map(|s| s.worker)
    }

    /// Number of open sessions.
    pub fn len(&self) -> usize {
        self.sessions.len()
    }

    /// Whether no session is open.
    pub fn is_empty(&self) -> bool {
        self.sessions.is_empty()
    }

    /// Hands each event to its stream; a stream ends here at its terminal event. Returns
    /// the streams the worker should stop: unknown here, or whose handler is gone.
    pub fn dispatch(&mut self, batch: TokenBatch) -> Vec<StreamId> {
        let mut stop = Vec::new();
        for event in batch.events {
            let terminal = !matches!(event.kind, EventKind::Token(_));
            let Some(session) = self.sessions.get(&event.stream) else {
                if !terminal && !stop.contains(&event.stream) {
                    debug!(stream = %event.stream, "event for an unknown stream");
                    stop.push(event.stream);
                }
                continue;
            };
            let delivered = session.events.send(event.kind).is_ok();
            if terminal || !delivered {
                self.sessions.remove(&event.stream);
            }
            if !delivered && !terminal {
                stop.push(event.stream);
            }
        }
        stop
    }

    /// Fails every stream that ran on `worker`; returns how many.
    pub fn worker_lost(&mut self, worker: WorkerId) -> usize {
        let lost: Vec<StreamId> = self
            .sessions
            .iter()
            .filter(|(_, s)| s.worker == worker)
            .map(|(id, _)| *id)
            .collect();
        for id in &lost {
            if let Some(s) = self.sessions.remove(id) {
                let _ = s.events.send(EventKind::Failed(WireError {
                    kind: ErrorKind::Internal,
                    message: format!("worker {worker} stopped responding"),
                }));
            }
        }
        lost.len()
    }
}

/// The sessions actor.
pub struct Sessions {
    /// Open streams.
    table: SessionTable,
    /// Where cancels are published.
    nats: NatsHandle,
}

impl Sessions {
    /// No open stream yet; cancels go out through `nats`.
    pub fn new(nats: NatsHandle) -> Self {
        Self {
            table: SessionTable::default(),
            nats,
        }
    }

    fn cancel(&self, worker: WorkerId, streams: Vec<StreamId>) {
        let nats = self.nats.clone();
        actix::spawn(async move {
            if let Err(e) = nats.cancel(worker, streams).await {
                warn!(%worker, error = %e, "cannot publish a cancel");
            }
        });
    }
}

/// Closes a stream's session when dropped, and releases its worker in the registry.
/// Unless [`SessionGuard::finish`] was called (the stream ended on the worker), the
/// worker is told to cancel: this is how a client that goes away stops its stream.
#[derive(Debug)]
pub struct SessionGuard {
    /// The stream.
    stream: StreamId,
    /// Its worker.
    worker: WorkerId,
    /// Where the session is.
    sessions: Addr<Sessions>,
    /// Where the worker's in-flight count is.
    registry: Addr<Registry>,
    /// The stream ended on the worker: no cancel needed.
    finished: bool,
}

impl SessionGuard {
    /// Guards `stream`, routed to `worker`.
    pub fn new(
        stream: StreamId,
        worker: WorkerId,
        sessions: Addr<Sessions>,
        registry: Addr<Registry>,
    ) -> Self {
        Self {
            stream,
            worker,
            sessions,
            registry,
            finished: false,
        }
    }

    /// The stream.
    pub fn stream(&self) -> StreamId {
        self.stream
    }

    /// The worker.
    pub fn worker(&self) -> WorkerId {
        self.worker
    }

    /// The stream ended on the worker (finished, failed, or refused).
    pub fn finish(&mut self) {
        self.finished = true;
    }
}

impl Drop for SessionGuard {
    fn drop(&mut self) {
        self.sessions.do_send(CloseSession {
            stream: self.stream,
            cancel: !self.finished,
        });
        self.registry.do_send(ReleaseWorker {
            worker: self.worker,
        });
    }
}

impl Actor for Sessions {
    type Context = Context<Self>;
}

impl Handler<OpenSession> for Sessions {
    type Result = ();

    fn handle(&mut self, msg: OpenSession, _: &mut Context<Self>) {
        self.table.open(msg.stream, msg.worker, msg.events);
    }
}

impl Handler<CloseSession> for Sessions {
    type Result = ();

    fn handle(&mut self, msg: CloseSession, _: &mut Context<Self>) {
        if let Some(worker) = self.table.close(msg.stream) {
            if msg.cancel {
                debug!(stream = %msg.stream, %worker, "client went away, cancelling");
                self.cancel(worker, vec![msg.stream]);
            }
        }
    }
}

impl Handler<DispatchTokens> for Sessions {
    type Result = ();

    fn handle(&mut self, msg: DispatchTokens, _: &mut Context<Self>) {
        let worker = msg.batch.worker;
        let stop = self.table.dispatch(msg.batch);
        if !stop.is_empty() {
            self.cancel(worker, stop);
        }
    }
}

impl Handler<WorkerLost> for Sessions {
    type Result = ();

    fn handle(&mut self, msg: WorkerLost, _: &mut Context<Self>) {
        let n = self.table.worker_lost(msg.worker);
        if n > 0 {
            warn!(worker = %msg.worker, streams = n, "worker lost, its streams fail");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use baton_common::protocol::{FinishReason, Finished, StreamEvent, TokenEvent};
    use tokio::sync::mpsc::unbounded_channel;

    fn token(stream: StreamId, index: u32) -> StreamEvent {
        StreamEvent {
            stream,
            kind: EventKind::Token(TokenEvent {
                index,
                id: 7,
                text: "x".into(),
            }),
        }
    }

    fn batch(events: Vec<StreamEvent>) -> TokenBatch {
        TokenBatch {
            worker: WorkerId(1),
            events,
        }
    }

    #[test]
    fn events_reach_their_stream_and_terminal_events_close_it() {
        let mut t = SessionTable::default();
        let (a, b) = (StreamId(1), StreamId(2));
        let (tx_a, mut rx_a) = unbounded_channel();
        let (tx_b, mut rx_b) = unbounded_channel();
        t.open(a, WorkerId(1), tx_a);
        t.open(b, WorkerId(1), tx_b);
        let finished = StreamEvent {
            stream: a,
            kind: EventKind::Finished(Finished {
                reason: FinishReason::Stop,
                prompt_tokens: 3,
                completion_tokens: 1,
            }),
        };
        assert!(t
            .dispatch(batch(vec![token(a, 0), token(b, 0), finished]))
            .is_empty());
        assert!(matches!(rx_a.try_recv(), Ok(EventKind::Token(_))));
        assert!(matches!(rx_a.try_recv(), Ok(EventKind::Finished(_))));
        assert!(matches!(rx_b.try_recv(), Ok(EventKind::Token(_))));
        assert_eq!(t.len(), 1);
        assert_eq!(t.close(a), None);
        assert_eq!(t.close(b), Some(WorkerId(1)));
    }

    #[test]
    fn unknown_or_abandoned_streams_are_stopped() {
        let mut t = SessionTable::default();
        let (tx, rx) = unbounded_channel();
        t.open(StreamId(1), WorkerId(1), tx);
        drop(rx);
        let stop = t.dispatch(batch(vec![
            token(StreamId(1), 0),
            token(StreamId(9), 0),
            token(StreamId(9), 1),
        ]));
        assert_eq!(stop, vec![StreamId(1), StreamId(9)]);
        assert!(t.is_empty());
    }

    #[test]
    fn a_lost_worker_fails_its_streams_only() {
        let mut t = SessionTable::default();
        let (tx_a, mut rx_a) = unbounded_channel();
        let (tx_b, _rx_b) = unbounded_channel();
        t.open(StreamId(1), WorkerId(1), tx_a);
        t.open(StreamId(2), WorkerId(2), tx_b);
        assert_eq!(t.worker_lost(WorkerId(1)), 1);
        assert!(matches!(rx_a.try_recv(), Ok(EventKind::Failed(_))));
        assert_eq!(t.len(), 1);
    }
}
