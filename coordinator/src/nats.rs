//! The coordinator's NATS side: connection, the two listeners (heartbeats, tokens),
//! submits and cancels.
//!
//! Every payload is decoded with [`baton_common::protocol::decode`] (checked); one that
//! is not a valid message of the expected kind is counted in [`Counters`] and dropped.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use actix::Addr;
use async_nats::{Client, RequestErrorKind};
use baton_common::ids::{CoordinatorId, StreamId, WorkerId};
use baton_common::protocol::{
    decode, Body, Cancel, DecodeError, SeqRequest, Sequencer, Submit, SubmitReply, Wire,
};
use baton_common::subjects::Subjects;
use futures::StreamExt;
use tracing::{info, warn};

use crate::actors::messages::{DispatchTokens, WorkerHeartbeat};
use crate::actors::registry::Registry;
use crate::actors::sessions::Sessions;

/// Counters of what went wrong on the wire.
#[derive(Debug, Default)]
pub struct Counters {
    /// Payloads that did not decode, or decoded to the wrong kind of message.
    pub garbage: AtomicU64,
}

impl Counters {
    /// Payloads dropped so far.
    pub fn garbage(&self) -> u64 {
        self.garbage.load(Ordering::Relaxed)
    }
}

/// Why a submit got no usable reply.
#[derive(Debug, thiserror::Error)]
pub enum SubmitError {
    /// Nobody listens on the worker's submit subject (it is gone).
    #[error("the worker does not answer (no responders)")]
    NoResponders,
    /// The worker did not answer in time.
    #[error("the worker did not answer within {0:?}")]
    Timeout(Duration),
    /// The request could not be sent.
    #[error("submit failed: {0}")]
    Request(String),
    /// The reply is not a valid message.
    #[error("malformed submit reply: {0}")]
    Decode(#[from] DecodeError),
    /// The reply is a valid message, but not a submit reply for this stream.
    #[error("unexpected submit reply: {0}")]
    Unexpected(&'static str),
}

/// Why a publish failed.
#[derive(Debug, thiserror::Error)]
#[error("publish failed: {0}")]
pub struct PublishError(String);

/// One envelope sequence per subject, as the protocol asks.
#[derive(Debug)]
struct Sequencers {
    publisher: u128,
    by_subject: Mutex<HashMap<String, Arc<Sequencer>>>,
}

impl Sequencers {
    fn encode(&self, subject: &str, body: Body) -> Vec<u8> {
        let seq = {
            let mut map = self
                .by_subject
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            map.entry(subject.to_string())
                .or_insert_with(|| Arc::new(Sequencer::new(self.publisher)))
                .clone()
        };
        seq.encode(body)
    }
}

/// A cloneable front to this coordinator's NATS connection.
#[derive(Debug, Clone)]
pub struct NatsHandle {
    /// The connection.
    client: Client,
    /// Subject names of this cluster.
    subjects: Subjects,
    /// Who we are (where workers send our tokens).
    coordinator: CoordinatorId,
    /// Envelope counters.
    sequencers: Arc<Sequencers>,
    /// Wire error counters.
    counters: Arc<Counters>,
}

impl NatsHandle {
    /// Connects to `url` as `coordinator`.
    pub async fn connect(
        url: &str,
        subjects: Subjects,
        coordinator: CoordinatorId,
    ) -> Result<Self, async_nats::ConnectError> {
        let client = async_nats::ConnectOptions::new()
            .name(format!("baton-coordinator-{coordinator}"))
            .connect(url)
            .await?;
        info!(%url, %coordinator, "connected to NATS");
        Ok(Self {
            client,
            subjects,
            coordinator,
            sequencers: Arc::new(Sequencers {
                publisher: coordinator.0,
                by_subject: Mutex::new(HashMap::new()),
            }),
            counters: Arc::new(Counters::default()),
        })
    }

    /// This coordinator's id.
    pub fn coordinator(&self) -> CoordinatorId {
        self.coordinator
    }

    /// Wire error counters.
    pub fn counters(&self) -> &Arc<Counters> {
        &self.counters
    }

    /// Subscribes to heartbeats and to this coordinator's tokens, and feeds them to the
    /// actors from two tasks on the current arbiter.
    pub async fn listen(
        &self,
        registry: Addr<Registry>,
        sessions: Addr<Sessions>,
    ) -> Result<(), async_nats::SubscribeError> {
        let mut heartbeats = self.client.subscribe(self.subjects.heartbeat()).await?;
        let mut tokens = self
            .client
            .subscribe(self.subjects.tokens(self.coordinator))
            .await?;
        // Subscriptions are registered on the server before anyone is told to submit.
        if let Err(e) = self.client.flush().await {
            warn!(error = %e, "NATS flush failed");
        }
        let counters = self.counters.clone();
        actix::spawn(async move {
            while let Some(msg) = heartbeats.next().await {
                match decode_counted(&msg.payload, &counters) {
                    Some(Body::Heartbeat(heartbeat)) => {
                        registry.do_send(WorkerHeartbeat { heartbeat })
                    }
                    Some(other) => unexpected(&counters, "heartbeat", &other),
                    None => {}
                }
            }
            warn!("heartbeat subscription ended");
        });
        let counters = self.counters.clone();
        actix::spawn(async move {
            while let Some(msg) = tokens.next().await {
                match decode_counted(&msg.payload, &counters) {
                    Some(Body::Tokens(batch)) => sessions.do_send(DispatchTokens { batch }),
                    Some(other) => unexpected(&counters, "tokens", &other),
                    None => {}
                }
            }
            warn!("token subscription ended");
        });
        Ok(())
    }

    /// Sends `sequences` to `worker` and waits up to `timeout` for its reply.
    pub async fn submit(
        &self,
        worker: WorkerId,
        sequences: Vec<SeqRequest>,
        timeout: Duration,
    ) -> Result<SubmitReply, SubmitError> {
        let subject = self.subjects.submit(worker);
        let payload = self.sequencers.encode(
            &subject,
            Body::Submit(Submit {
                coordinator: self.coordinator,
                sequences,
            }),
        );
        let request = async_nats::Request::new()
            .payload(payload.into())
            .timeout(Some(timeout));
        let reply = self
            .client
            .send_request(subject, request)
            .await
            .map_err(|e| match e.kind() {
                RequestErrorKind::NoResponders => SubmitError::NoResponders,
                RequestErrorKind::TimedOut => SubmitError::Timeout(timeout),
                RequestErrorKind::InvalidSubject
                | RequestErrorKind::MaxPayloadExceeded
                | RequestErrorKind::Other => SubmitError::Request(e.to_string()),
            })?;
        match decode(&reply.payload)?.body {
            Body::SubmitReply(reply) => Ok(reply),
            _ => Err(SubmitError::Unexpected("not a submit reply")),
        }
    }

    /// Tells `worker` to stop `streams`.
    pub async fn cancel(
        &self,
        worker: WorkerId,
        streams: Vec<StreamId>,
    ) -> Result<(), PublishError> {
        let subject = self.subjects.cancel(worker);
        let payload = self
            .sequencers
            .encode(&subject, Body::Cancel(Cancel { streams }));
        self.client
            .publish(subject, payload.into())
            .await
            .map_err(|e| PublishError(e.to_string()))
    }
}

/// Decodes a payload; garbage is counted, logged and dropped.
fn decode_counted(payload: &[u8], counters: &Counters) -> Option<Body> {
    match decode(payload) {
        Ok(Wire { body, .. }) => Some(body),
        Err(e) => {
            counters.garbage.fetch_add(1, Ordering::Relaxed);
            warn!(kind = e.kind(), error = %e, bytes = payload.len(), "dropping a malformed message");
            None
        }
    }
}

fn unexpected(counters: &Counters, subject: &str, body: &Body) {
    counters.garbage.fetch_add(1, Ordering::Relaxed);
    let kind = match body {
        Body::Heartbeat(_) => "heartbeat",
        Body::Submit(_) => "submit",
        Body::SubmitReply(_) => "submit reply",
        Body::Cancel(_) => "cancel",
        Body::Tokens(_) => "tokens",
    };
    warn!(subject, kind, "dropping a message of the wrong kind");
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn garbage_is_counted_not_fatal() {
        let counters = Counters::default();
        assert!(decode_counted(b"not a message", &counters).is_none());
        assert!(decode_counted(&[], &counters).is_none());
        assert_eq!(counters.garbage(), 2);
        let seqs = Sequencers {
            publisher: 1,
            by_subject: Mutex::new(HashMap::new()),
        };
        let bytes = seqs.encode("a", Body::Cancel(Cancel { streams: vec![] }));
        assert!(matches!(
            decode_counted(&bytes, &counters),
            Some(Body::Cancel(_))
        ));
        assert_eq!(counters.garbage(), 2);
    }

    #[test]
    fn envelope_sequences_count_per_subject() {
        let seqs = Sequencers {
            publisher: 1,
            by_subject: Mutex::new(HashMap::new()),
        };
        let body = || Body::Cancel(Cancel { streams: vec![] });
        let seq = |b: Vec<u8>| decode(&b).expect("decode").envelope.seq;
        assert_eq!(seq(seqs.encode("a", body())), 0);
        assert_eq!(seq(seqs.encode("a", body())), 1);
        assert_eq!(seq(seqs.encode("b", body())), 0);
    }
}
