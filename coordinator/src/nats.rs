//! The coordinator's NATS side: connection, the two listeners (heartbeats, tokens),
//! submits and cancels.
//!
//! Every payload is decoded with [`baton_common::protocol::decode`] (checked); one that
//! is not a valid message of the expected kind is counted in [`Counters`] and dropped.

use std::collections::HashMap;
use std::num::NonZeroUsize;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use actix::Recipient;
use async_nats::{Client, RequestErrorKind};
use baton_common::config::NatsConfig;
use baton_common::ids::{CoordinatorId, StreamId, WorkerId};
use baton_common::nats::NatsConnectError;
use baton_common::protocol::{
    decode, Body, Cancel, DecodeError, DrainReply, DrainWorker, LoadModel, ModelReply, SeqRequest,
    Sequencer, StreamAttempt, Submit, SubmitReply, TokenizeReply, TokenizeRequest, UnloadModel,
    Wire,
};
use baton_common::subjects::{Subjects, REQUEST_ID_HEADER};
use baton_common::throttle::Throttle;
use futures::{FutureExt, StreamExt};
use lru::LruCache;
use tracing::{info, warn};

use crate::actors::messages::{DispatchTokens, WorkerHeartbeat};

/// Counters of what went wrong on the wire.
#[derive(Debug, Default)]
pub struct Counters {
    /// Payloads that did not decode, or decoded to the wrong kind of message.
    pub garbage: AtomicU64,
    /// Token messages that never arrived (gaps in a worker's envelope sequence).
    pub missed: AtomicU64,
}

impl Counters {
    /// Payloads dropped so far.
    pub fn garbage(&self) -> u64 {
        self.garbage.load(Ordering::Relaxed)
    }

    /// Token messages lost so far.
    pub fn missed(&self) -> u64 {
        self.missed.load(Ordering::Relaxed)
    }
}

/// What a probe learned about a worker.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Probe {
    /// It answered; these of the probed streams it does not hold.
    Alive(Vec<(StreamId, u32)>),
    /// Nobody listens on its subject: the process is gone.
    Gone,
    /// No answer in time (it may be busy, or NATS may be down): nothing learned.
    Unknown,
}

/// Most token messages handed to the sessions at once.
const MAX_TOKEN_MESSAGES: usize = 256;

/// Most publishers whose token sequence is followed; the one heard from longest ago is
/// forgotten first (every restarted worker is a new publisher).
const GAP_PUBLISHERS: usize = 4096;

/// Counts the token messages each publisher's envelope sequence says were lost.
#[derive(Debug)]
struct GapCounter {
    /// The next sequence number expected of each publisher.
    next: LruCache<u128, u64>,
}

impl GapCounter {
    /// Follows at most `publishers` publishers (at least one).
    fn new(publishers: usize) -> Self {
        Self {
            next: LruCache::new(NonZeroUsize::new(publishers.max(1)).expect("at least one")),
        }
    }

    /// Records message `seq` of `publisher`; returns how many were skipped before it.
    fn observe(&mut self, publisher: u128, seq: u64) -> u64 {
        let expected = self.next.get_or_insert_mut(publisher, || seq);
        let missed = seq.saturating_sub(*expected);
        if seq >= *expected {
            *expected = seq + 1;
        }
        missed
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
    #[error("cannot send to the worker: {0}")]
    Request(String),
    /// The message is larger than the NATS server takes (`max_payload`).
    #[error("the message is larger than the NATS server's max_payload: {0}")]
    TooLarge(String),
    /// The reply is not a valid message.
    #[error("malformed submit reply: {0}")]
    Decode(#[from] DecodeError),
    /// The reply is a valid message, but not a submit reply for this stream.
    #[error("unexpected submit reply: {0}")]
    Unexpected(&'static str),
}

impl SubmitError {
    /// Whether the worker is gone, or was lost with the submit in flight: the sequence
    /// does not run there (a late acceptance's events are dropped and cancelled), and
    /// another worker may take it.
    pub fn worker_lost(&self) -> bool {
        matches!(self, SubmitError::NoResponders | SubmitError::Timeout(_))
    }

    /// The error of a request to a worker that waited up to `timeout`.
    fn from_request(e: &async_nats::RequestError, timeout: Duration) -> Self {
        match e.kind() {
            RequestErrorKind::NoResponders => SubmitError::NoResponders,
            RequestErrorKind::TimedOut => SubmitError::Timeout(timeout),
            RequestErrorKind::MaxPayloadExceeded => SubmitError::TooLarge(e.to_string()),
            RequestErrorKind::InvalidSubject | RequestErrorKind::Other => {
                SubmitError::Request(e.to_string())
            }
        }
    }
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

    /// Drops the sequences of `subjects` (their receiver is gone).
    fn forget(&self, subjects: &[String]) {
        let mut map = self
            .by_subject
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        for subject in subjects {
            map.remove(subject);
        }
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
    /// Connects as `coordinator`, with the credentials and TLS settings of `config`.
    pub async fn connect(
        config: &NatsConfig,
        subjects: Subjects,
        coordinator: CoordinatorId,
    ) -> Result<Self, NatsConnectError> {
        let client =
            baton_common::nats::connect(config, &format!("baton-coordinator-{coordinator}"))
                .await?;
        let url = &config.url;
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

    /// Largest message the NATS server takes (headers and payload), as it said when we
    /// connected.
    pub fn max_payload(&self) -> usize {
        self.client.server_info().max_payload
    }

    /// This coordinator's id.
    pub fn coordinator(&self) -> CoordinatorId {
        self.coordinator
    }

    /// Wire error counters.
    pub fn counters(&self) -> &Arc<Counters> {
        &self.counters
    }

    /// The connection (the public API publishes its replies on it).
    pub fn client(&self) -> &Client {
        &self.client
    }

    /// Subject names of this cluster.
    pub fn subjects(&self) -> &Subjects {
        &self.subjects
    }

    /// Forgets the envelope sequences of `worker`'s subjects: it left the registry, and a
    /// restarted worker has a new id. Should it be heard from again, its messages are
    /// numbered from 0.
    pub fn forget_worker(&self, worker: WorkerId) {
        self.sequencers
            .forget(&[self.subjects.submit(worker), self.subjects.cancel(worker)]);
    }

    /// Subscribes to heartbeats and to this coordinator's tokens, and feeds them to the
    /// actors from two tasks on the current arbiter.
    pub async fn listen(
        &self,
        registry: Recipient<WorkerHeartbeat>,
        sessions: Recipient<DispatchTokens>,
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
            let mut gaps = GapCounter::new(GAP_PUBLISHERS);
            // Every message that has arrived goes to the sessions in one batch: one
            // checkpoint flush for all of them (group commit).
            while let Some(first) = tokens.next().await {
                let mut batches = Vec::new();
                let mut next = Some(first);
                while let Some(msg) = next.take() {
                    match decode_wire_counted(&msg.payload, &counters) {
                        Some(Wire {
                            envelope,
                            body: Body::Tokens(batch),
                        }) => {
                            let missed = gaps.observe(envelope.publisher, envelope.seq);
                            if missed > 0 {
                                counters.missed.fetch_add(missed, Ordering::Relaxed);
                                warn!(worker = %batch.worker, missed, "token messages lost");
                            }
                            batches.push(batch);
                        }
                        Some(other) => unexpected(&counters, "tokens", &other.body),
                        None => {}
                    }
                    if batches.len() < MAX_TOKEN_MESSAGES {
                        next = tokens.next().now_or_never().flatten();
                    }
                }
                if !batches.is_empty() {
                    sessions.do_send(DispatchTokens { batches });
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
        // The request id (the stream id) travels in a header too, for the worker's logs.
        let mut headers = async_nats::HeaderMap::new();
        let ids: Vec<String> = sequences.iter().map(|s| s.stream.to_string()).collect();
        headers.insert(REQUEST_ID_HEADER, ids.join(",").as_str());
        let payload = self.sequencers.encode(
            &subject,
            Body::Submit(Submit {
                coordinator: self.coordinator,
                sequences,
            }),
        );
        match self.ask(subject, payload, Some(headers), timeout).await? {
            Body::SubmitReply(reply) => Ok(reply),
            _ => Err(SubmitError::Unexpected("not a submit reply")),
        }
    }

    /// Publishes `payload` on a worker's `subject` and waits up to `timeout` for the
    /// body of its reply.
    async fn ask(
        &self,
        subject: String,
        payload: Vec<u8>,
        headers: Option<async_nats::HeaderMap>,
        timeout: Duration,
    ) -> Result<Body, SubmitError> {
        let mut request = async_nats::Request::new()
            .payload(payload.into())
            .timeout(Some(timeout));
        if let Some(headers) = headers {
            request = request.headers(headers);
        }
        let reply = self
            .client
            .send_request(subject, request)
            .await
            .map_err(|e| SubmitError::from_request(&e, timeout))?;
        Ok(decode(&reply.payload)?.body)
    }

    /// Asks `worker` whether it is alive and still holds `streams`, waiting up to
    /// `timeout`.
    pub async fn probe(
        &self,
        worker: WorkerId,
        streams: Vec<(StreamId, u32)>,
        timeout: Duration,
    ) -> Probe {
        let subject = self.subjects.submit(worker);
        let streams = streams
            .into_iter()
            .map(|(stream, attempt)| StreamAttempt { stream, attempt })
            .collect();
        let payload = self.sequencers.encode(
            &subject,
            Body::Probe(baton_common::protocol::Probe { streams }),
        );
        let request = async_nats::Request::new()
            .payload(payload.into())
            .timeout(Some(timeout));
        match self.client.send_request(subject, request).await {
            Ok(reply) => match decode(&reply.payload) {
                Ok(Wire {
                    body: Body::ProbeReply(r),
                    ..
                }) => Probe::Alive(r.missing.iter().map(|s| (s.stream, s.attempt)).collect()),
                _ => Probe::Unknown,
            },
            Err(e) if e.kind() == RequestErrorKind::NoResponders => Probe::Gone,
            Err(_) => Probe::Unknown,
        }
    }

    /// Tells `worker` to drain (request/reply on its submit subject), handing its
    /// streams over after `handover_after_ms` (`None`: its own setting), waiting up to
    /// `timeout` for it to confirm.
    pub async fn drain(
        &self,
        worker: WorkerId,
        reason: String,
        handover_after_ms: Option<u64>,
        timeout: Duration,
    ) -> Result<DrainReply, SubmitError> {
        let subject = self.subjects.submit(worker);
        let payload = self.sequencers.encode(
            &subject,
            Body::Drain(DrainWorker {
                reason,
                handover_after_ms,
            }),
        );
        match self.ask(subject, payload, None, timeout).await? {
            Body::DrainReply(reply) => Ok(reply),
            _ => Err(SubmitError::Unexpected("not a drain reply")),
        }
    }

    /// Orders `worker` to load a model file (request/reply on its submit subject),
    /// waiting up to `timeout` for it to have loaded and self-tested it, or refused it.
    pub async fn load_model(
        &self,
        worker: WorkerId,
        order: LoadModel,
        timeout: Duration,
    ) -> Result<ModelReply, SubmitError> {
        self.model_order(worker, Body::LoadModel(order), timeout)
            .await
    }

    /// Orders `worker` to stop serving a model, waiting up to `timeout`.
    pub async fn unload_model(
        &self,
        worker: WorkerId,
        name: String,
        timeout: Duration,
    ) -> Result<ModelReply, SubmitError> {
        self.model_order(worker, Body::UnloadModel(UnloadModel { name }), timeout)
            .await
    }

    async fn model_order(
        &self,
        worker: WorkerId,
        body: Body,
        timeout: Duration,
    ) -> Result<ModelReply, SubmitError> {
        let subject = self.subjects.submit(worker);
        let payload = self.sequencers.encode(&subject, body);
        match self.ask(subject, payload, None, timeout).await? {
            Body::ModelReply(reply) => Ok(reply),
            _ => Err(SubmitError::Unexpected("not a model reply")),
        }
    }

    /// Asks `worker` to tokenize or detokenize (request/reply on its submit subject),
    /// waiting up to `timeout`.
    pub async fn tokenize(
        &self,
        worker: WorkerId,
        request: TokenizeRequest,
        timeout: Duration,
    ) -> Result<TokenizeReply, SubmitError> {
        let subject = self.subjects.submit(worker);
        let payload = self.sequencers.encode(&subject, Body::Tokenize(request));
        match self.ask(subject, payload, None, timeout).await? {
            Body::TokenizeReply(reply) => Ok(reply),
            _ => Err(SubmitError::Unexpected("not a tokenize reply")),
        }
    }

    /// Tells `worker` to stop `streams` (each up to the attempt given).
    pub async fn cancel(
        &self,
        worker: WorkerId,
        streams: Vec<(StreamId, u32)>,
    ) -> Result<(), PublishError> {
        let subject = self.subjects.cancel(worker);
        let streams = streams
            .into_iter()
            .map(|(stream, attempt)| StreamAttempt { stream, attempt })
            .collect();
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
    decode_wire_counted(payload, counters).map(|w| w.body)
}

/// Decodes a payload with its envelope; garbage is counted, logged and dropped.
fn decode_wire_counted(payload: &[u8], counters: &Counters) -> Option<Wire> {
    match decode(payload) {
        Ok(wire) => Some(wire),
        Err(e) => {
            counters.garbage.fetch_add(1, Ordering::Relaxed);
            if let Some(held) = GARBAGE_WARNINGS.admit() {
                warn!(kind = e.kind(), error = %e, bytes = payload.len(), held_back = held, "dropping a malformed message");
            }
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
        Body::Probe(_) => "probe",
        Body::ProbeReply(_) => "probe reply",
        Body::Drain(_) => "drain",
        Body::DrainReply(_) => "drain reply",
        Body::Tokenize(_) => "tokenize",
        Body::TokenizeReply(_) => "tokenize reply",
        Body::LoadModel(_) => "load model",
        Body::UnloadModel(_) => "unload model",
        Body::ModelReply(_) => "model reply",
    };
    if let Some(held) = GARBAGE_WARNINGS.admit() {
        warn!(
            subject,
            kind,
            held_back = held,
            "dropping a message of the wrong kind"
        );
    }
}

/// Garbage on the subjects this coordinator reads is logged once a second (the count of
/// what was held back goes with it; the metrics count each message).
static GARBAGE_WARNINGS: Throttle = Throttle::new(Duration::from_secs(1));

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
    fn gaps_are_counted_per_publisher() {
        let mut g = GapCounter::new(8);
        assert_eq!(g.observe(1, 5), 0, "the first message sets the start");
        assert_eq!(g.observe(1, 6), 0);
        assert_eq!(g.observe(2, 0), 0);
        assert_eq!(g.observe(1, 9), 2);
        assert_eq!(g.observe(1, 9), 0, "a duplicate is no gap");
        assert_eq!(g.observe(1, 10), 0);
    }

    #[test]
    fn gap_counting_follows_a_bounded_number_of_publishers() {
        let mut g = GapCounter::new(3);
        for publisher in 0..100 {
            assert_eq!(g.observe(publisher, 0), 0);
        }
        assert_eq!(
            g.next.len(),
            3,
            "publishers heard from longest ago are dropped"
        );
        assert_eq!(g.observe(99, 3), 2, "recent publishers are still followed");
    }

    #[test]
    fn a_forgotten_subject_starts_again_and_leaves_the_map() {
        let seqs = Sequencers {
            publisher: 1,
            by_subject: Mutex::new(HashMap::new()),
        };
        let body = || Body::Cancel(Cancel { streams: vec![] });
        let seq = |b: Vec<u8>| decode(&b).expect("decode").envelope.seq;
        seqs.encode("a", body());
        seqs.encode("b", body());
        seqs.forget(&["a".to_string()]);
        let held = |s: &Sequencers| s.by_subject.lock().expect("lock").len();
        assert_eq!(held(&seqs), 1);
        assert_eq!(seq(seqs.encode("a", body())), 0);
        assert_eq!(seq(seqs.encode("b", body())), 1);
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
