//! Stream sessions: every stream's state, checkpoints, failover and subscribers.
//!
//! A session lives from the request until its stream ends. It holds the request, every
//! token so far (id, text) and the chain hash after the last one, the worker running the
//! current attempt, and the channels of the clients listening.
//!
//! - **Tokens** arrive in worker messages ([`DispatchTokens`]). Each event is checked
//!   against the session (right attempt, next position) and appended to the checkpoint
//!   store; in `sync` mode the store is flushed (write + sync) before the tokens go to
//!   the clients, and in `async` mode (the default) only a new stream's tokens may
//!   wait, for the flush that takes its record to disk. One flush runs at a time;
//!   everything that arrives meanwhile waits for the next one (group commit), and the
//!   actor keeps serving other messages. A client that attaches gets the tokens
//!   already forwarded, then the rest with everyone else.
//! - **Failover**: a stream moves to another worker — a *resume* with every token so
//!   far and the last chain hash — when its worker fails it, when the registry drops
//!   the worker (heartbeats stopped), when a probe finds nobody on the worker's subject,
//!   when its events skip a position (a lost message), or when it stalls past
//!   `stall_timeout_ms` although the worker answers. Each dispatch of a stream is an
//!   *attempt*; events of older attempts are dropped and their sequences cancelled.
//! - **Clients** subscribe with [`StartStream`] (new) or [`Attach`] (reconnect with
//!   `Last-Event-ID`: the tokens after the given position are replayed from memory or the
//!   store, then the live rest follows). A client may attach only to a stream its
//!   [`StreamAccess`] allows (its own key's, or any for an admin key); any other stream
//!   is unknown to it, exactly as one that never existed. When the last client of a
//!   stream goes away, the worker is told to stop at once; a client that comes back
//!   within the reconnect window resumes the stream from its checkpoint. After the
//!   window the stream is dropped from memory and the store, so that streams nobody
//!   comes back to do not pile up.
//! - **Restart**: streams the store holds unfinished are dispatched again when the
//!   coordinator starts ([`Sessions::recover`]), and run to their end with or without a
//!   client, so that a client reconnecting to the new process gets its whole text.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use actix::prelude::*;
use baton_common::config::CheckpointMode;
use baton_common::ids::{StreamId, WorkerId};
use baton_common::protocol::{
    submit_bytes, tool_call_id, ErrorKind, EventKind, FinishReason, Finished, PromptEcho, Resume,
    SeqRequest, TokenBatch, TokenEvent, TokenLogprobs, ToolCall, WireError,
};
use tokio::sync::mpsc::UnboundedSender;
use tokio::sync::oneshot;
use tracing::{debug, info, warn};

/// Why a stream moves to another worker (or starts again on one).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ResumeReason {
    /// Its worker failed it (`internal`).
    WorkerFailed,
    /// Its draining worker handed it over: planned, not counted against `max_resumes`.
    HandedOver,
    /// Its events skipped a position (a lost message).
    TokensMissing,
    /// Its worker said it finished with fewer tokens than the stream holds, or cancelled.
    EndedEarly,
    /// No progress for its stall window although the worker answers.
    Stalled,
    /// A probe found the worker alive without the stream.
    LostByWorker,
    /// A probe found nobody on the worker's subject.
    NoResponders,
    /// The registry dropped the worker (heartbeats stopped).
    LeftRegistry,
    /// A client came back to a detached stream: not a failure either.
    Reattached,
}

impl ResumeReason {
    /// What logs and the `stream_resumes_total{reason}` metric say.
    pub fn as_str(self) -> &'static str {
        match self {
            ResumeReason::WorkerFailed => "the worker failed it",
            ResumeReason::HandedOver => "handed over by a draining worker",
            ResumeReason::TokensMissing => "tokens missing",
            ResumeReason::EndedEarly => "the stream ended early",
            ResumeReason::Stalled => "stalled",
            ResumeReason::LostByWorker => "the worker lost it",
            ResumeReason::NoResponders => "no responders",
            ResumeReason::LeftRegistry => "left the registry",
            ResumeReason::Reattached => "a client reattached",
        }
    }

    /// Whether the move counts towards `max_resumes` (a failure, not a plan).
    fn counts(self) -> bool {
        !matches!(self, ResumeReason::HandedOver | ResumeReason::Reattached)
    }
}

use super::messages::{DispatchTokens, ForgetWorker, ReleaseWorker, WorkerLost};
use super::registry::Registry;
use crate::auth::{KeyId, Owner, StreamAccess};
use crate::dispatch::{Bound, DispatchError, Dispatcher};
use crate::metrics::Metrics;
use crate::nats::{NatsHandle, Probe, SubmitError};
use crate::store::{Store, StoredToken, StreamEnd, StreamRecord};

/// What a stream's clients receive.
#[derive(Debug, Clone, PartialEq)]
pub enum Update {
    /// A token's text at its position.
    Token {
        /// Position in the output.
        index: u32,
        /// Text that became final with it (may be empty).
        text: String,
        /// The chain hash after it (hₚ): a reconnecting client names it with the
        /// position, so that a regenerated stream is checked against what it holds.
        hash: u64,
        /// Its logprobs, when the request asked.
        logprobs: Option<TokenLogprobs>,
        /// Tool calls it completed (named: `call_…`).
        tool_calls: Vec<ToolCall>,
    },
    /// The scored prompt (a completion's `echo`), before the first token.
    Prompt(PromptEcho),
    /// The worker ran part of a long prompt: nothing to show, but the stream is alive.
    Progress,
    /// The stream ended normally.
    Finished(Finished),
    /// The stream failed.
    Failed(WireError),
}

/// Failover and retention settings.
#[derive(Debug, Clone)]
pub struct SessionSettings {
    /// When tokens reach clients relative to the store.
    pub checkpoint: CheckpointMode,
    /// How long ended streams stay in the store.
    pub reconnect_window: Duration,
    /// Silence after which a stream's worker is probed.
    pub stall_probe: Duration,
    /// Silence after which a stream moves even though its worker answers.
    pub stall_timeout: Duration,
    /// How long a resumed stream waits for a worker.
    pub resume_deadline: Duration,
    /// Most resumes per stream.
    pub max_resumes: u32,
    /// Most new streams in one submit.
    pub max_batch: usize,
    /// Longest wait of a new stream for others to share its submit.
    pub max_wait: Duration,
    /// Most streams running at once (dispatching or on a worker).
    pub max_streams: usize,
    /// Most detached streams held for a reattach.
    pub max_detached: usize,
    /// Most detached streams of one API key.
    pub max_detached_per_key: usize,
}

/// Prompt tokens a stall window covers before a stream's first token.
const PROMPT_TOKENS_PER_WINDOW: u32 = 1024;

/// A new stream's answer channel: whether a worker took it.
type Reply = oneshot::Sender<Result<u32, DispatchError>>;

/// Bytes a submit's NATS headers may take beside its payload: the fixed part, and each
/// sequence's stream id in the request-id header.
const HEADER_BYTES: usize = 256;
const HEADER_BYTES_PER_STREAM: usize = 40;

/// A new stream waiting to share a submit.
#[derive(Debug)]
struct Waiting {
    stream: StreamId,
    reply: Reply,
    /// Its largest submit on the wire ([`submit_bytes`]), headers included.
    bytes: usize,
}

/// Where a session stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// Being offered to workers (new, or resumed).
    Dispatching,
    /// Running on a worker.
    Running(WorkerId),
    /// No client listens; the worker was told to stop. A client that attaches within
    /// the reconnect window resumes it; after that, the stream is forgotten.
    Detached {
        /// When the last client went away.
        since: Instant,
    },
}

/// A client of a stream: its channel and the first position it has not seen.
#[derive(Debug)]
struct Subscriber {
    tx: UnboundedSender<Update>,
    /// Tokens before this position are not sent again: a client that reconnects with
    /// `Last-Event-ID` after a coordinator restart may hold tokens the store lost (in
    /// `async` mode), which the resumed stream regenerates.
    next: u32,
    /// The position and chain hash of the client's last token when the session did not
    /// have it yet: the regenerated token there must carry the same hash, else the
    /// client holds another text and its stream fails.
    expect: Option<(u32, u64)>,
}

/// A token a session holds.
#[derive(Debug, Clone)]
struct Held {
    id: u32,
    /// Chain hash after it.
    hash: u64,
    text: String,
    logprobs: Option<TokenLogprobs>,
    tool_calls: Vec<ToolCall>,
}

/// One stream.
#[derive(Debug)]
struct Session {
    /// The request and its answer's shape, as stored.
    record: StreamRecord,
    /// Tokens so far.
    tokens: Vec<Held>,
    /// How many of them reached the clients (the rest wait for a checkpoint flush).
    forwarded: usize,
    /// Prompt length, as a worker counted it.
    prompt_tokens: u32,
    phase: Phase,
    /// Clients listening.
    subscribers: Vec<Subscriber>,
    /// Whether the stream's record has reached the disk (`async` mode holds its tokens
    /// back from clients until it has, so that a client never holds a stream that a
    /// restarted coordinator does not know).
    durable: bool,
    /// Dispatched again after a restart: runs to its end even with no client.
    orphan: bool,
    /// Last time it moved (token, dispatch).
    last_progress: Instant,
    /// Resumes so far.
    resumes: u32,
}

impl Session {
    fn new(record: StreamRecord, tokens: Vec<Held>) -> Self {
        Self {
            forwarded: tokens.len(),
            record,
            tokens,
            prompt_tokens: 0,
            phase: Phase::Dispatching,
            subscribers: Vec::new(),
            durable: true,
            orphan: false,
            last_progress: Instant::now(),
            resumes: 0,
        }
    }

    /// Whether any client still listens (dropping closed channels).
    fn listened(&mut self) -> bool {
        self.subscribers.retain(|s| !s.tx.is_closed());
        self.orphan || !self.subscribers.is_empty()
    }

    /// Adds a client that has every token before position `next` (and, when `expect`
    /// is given, the chain hash there that a token still to come must match).
    fn subscribe(&mut self, tx: UnboundedSender<Update>, next: u32, expect: Option<(u32, u64)>) {
        self.subscribers.push(Subscriber { tx, next, expect });
    }

    fn send(&mut self, update: &Update) {
        self.subscribers.retain_mut(|s| match update {
            Update::Token { index, hash, .. } if *index < s.next => match s.expect {
                Some((at, want)) if at == *index && want != *hash => {
                    let _ = s.tx.send(Update::Failed(diverged(*index)));
                    false
                }
                Some((at, _)) if at == *index => {
                    s.expect = None;
                    !s.tx.is_closed()
                }
                _ => !s.tx.is_closed(),
            },
            Update::Token { index, .. } => {
                s.next = index + 1;
                s.tx.send(update.clone()).is_ok()
            }
            _ => s.tx.send(update.clone()).is_ok(),
        });
    }

    fn attempt(&self) -> u32 {
        self.record.attempt
    }

    /// How long it may be silent before it moves although its worker answers: before
    /// its first token the worker may be running a long prompt in one step, so the
    /// window grows with the prompt (one more `stall_timeout` a 1,024 tokens).
    fn stall_window(&self, stall_timeout: Duration) -> Duration {
        if !self.tokens.is_empty() {
            return stall_timeout;
        }
        stall_timeout.saturating_mul(1 + self.prompt_tokens / PROMPT_TOKENS_PER_WINDOW)
    }

    /// The update that replays held token `index`.
    fn replay(&self, index: usize) -> Update {
        let t = &self.tokens[index];
        Update::Token {
            index: index as u32,
            text: t.text.clone(),
            hash: t.hash,
            logprobs: t.logprobs.clone(),
            tool_calls: t.tool_calls.clone(),
        }
    }

    /// The request of the next dispatch: a resume from the tokens so far.
    fn request(&self) -> SeqRequest {
        let mut req = self.record.request.clone();
        req.attempt = self.record.attempt;
        req.resume = self.tokens.last().map(|last| Resume {
            tokens: self.tokens.iter().map(|t| t.id).collect(),
            hash: last.hash,
        });
        // A prompt already scored is not scored again (unless scoring is all it asks).
        if self.record.prompt.is_some() && req.params.max_tokens > 0 {
            req.params.prompt_logprobs = None;
        }
        req
    }
}

/// Streams no client may reattach to any more: those whose last client left at least
/// `window` before `now`, then the oldest detached ones past `max` in all or past
/// `per_key` of one API key.
fn abandoned(
    sessions: &HashMap<StreamId, Session>,
    now: Instant,
    window: Duration,
    max: usize,
    per_key: usize,
) -> Vec<StreamId> {
    let mut detached: Vec<(Instant, StreamId, Option<KeyId>)> = sessions
        .iter()
        .filter_map(|(id, s)| match s.phase {
            Phase::Detached { since } => Some((since, *id, s.record.owner)),
            Phase::Dispatching | Phase::Running(_) => None,
        })
        .collect();
    // Newest first: what is kept is a prefix of each list.
    detached.sort_unstable_by_key(|d| std::cmp::Reverse(d.0));
    let mut per_owner: HashMap<KeyId, usize> = HashMap::new();
    let mut kept = 0;
    detached
        .into_iter()
        .filter(|(since, _, owner)| {
            let held = match owner {
                Some(key) => {
                    let n = per_owner.entry(*key).or_default();
                    *n += 1;
                    *n <= per_key
                }
                None => true,
            };
            let keep = now.saturating_duration_since(*since) < window && held && kept < max;
            kept += usize::from(keep);
            !keep
        })
        .map(|(_, id, _)| id)
        .collect()
}

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
}

/// Attach a client to a stream (sessions): replay after `after`, then live updates.
#[derive(Debug, Message)]
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

/// A client's channel closed (sessions): when no client is left, the worker stops.
#[derive(Debug, Message)]
#[rtype(result = "()")]
pub struct Detach {
    /// The stream.
    pub stream: StreamId,
}

/// Sessions in memory, and which workers are being probed.
pub struct Sessions {
    sessions: HashMap<StreamId, Session>,
    settings: SessionSettings,
    dispatcher: Dispatcher,
    nats: NatsHandle,
    registry: Addr<Registry>,
    store: Option<Store>,
    /// Workers with a probe in flight.
    probing: HashSet<WorkerId>,
    /// When each worker last answered a probe.
    answered: HashMap<WorkerId, Instant>,
    /// Streams to dispatch again once started (recovered from the store).
    recovered: Vec<StreamId>,
    /// Updates written to the store, waiting for the next flush (`sync` mode; in
    /// `async` mode, those of streams whose record is not yet on disk).
    pending: Vec<(StreamId, Update)>,
    /// Streams whose record the next flush takes to disk (`async` mode).
    undurable: Vec<StreamId>,
    /// Whether a flush is running; updates arriving meanwhile wait for the next one
    /// (group commit).
    flushing: bool,
    /// Resumes, reattaches and flush times are counted here.
    metrics: Arc<Metrics>,
    /// New streams waiting to share a submit, by model.
    waiting: HashMap<String, Vec<Waiting>>,
    /// When each model's last submit went out.
    last_submit: HashMap<String, Instant>,
}

/// The failure a client gets when the regenerated token at `index` is not the one it
/// holds.
fn diverged(index: u32) -> WireError {
    WireError {
        kind: ErrorKind::ChainMismatch,
        message: format!(
            "the resumed stream produced another token at position {index} than the one this client holds"
        ),
    }
}

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

impl Sessions {
    /// No session yet. `store` is `None` when checkpoints are off.
    pub fn new(
        settings: SessionSettings,
        dispatcher: Dispatcher,
        store: Option<Store>,
        metrics: Arc<Metrics>,
    ) -> Self {
        Self {
            sessions: HashMap::new(),
            nats: dispatcher.nats.clone(),
            registry: dispatcher.registry.clone(),
            settings,
            dispatcher,
            store,
            probing: HashSet::new(),
            answered: HashMap::new(),
            recovered: Vec::new(),
            pending: Vec::new(),
            undurable: Vec::new(),
            flushing: false,
            metrics,
            waiting: HashMap::new(),
            last_submit: HashMap::new(),
        }
    }

    /// Loads the store's unfinished streams; they are dispatched again (resumed from
    /// their last token) when the actor starts. Returns how many.
    pub fn recover(&mut self) -> usize {
        let Some(store) = &self.store else { return 0 };
        let open = match store.unfinished() {
            Ok(open) => open,
            Err(e) => {
                warn!(error = %e, "cannot read unfinished streams from the store");
                return 0;
            }
        };
        for (stream, mut record) in open {
            let tokens = match store.tokens(stream, 0) {
                Ok(t) => t,
                Err(e) => {
                    warn!(%stream, error = %e, "cannot read a stream's tokens; skipping it");
                    continue;
                }
            };
            // Keep the longest run of positions 0, 1, 2, … (a damaged tail is regenerated).
            let mut run: Vec<StoredToken> = Vec::with_capacity(tokens.len());
            for t in tokens {
                if t.index as usize != run.len() {
                    break;
                }
                run.push(t);
            }
            let old = record.worker.take();
            let attempt = record.attempt;
            let mut session = Session::new(
                record,
                run.into_iter()
                    .map(|t| Held {
                        id: t.id,
                        hash: t.hash,
                        text: t.text,
                        logprobs: t.logprobs,
                        tool_calls: t.tool_calls,
                    })
                    .collect(),
            );
            session.orphan = true;
            if let Some(worker) = old {
                // The old attempt may still run there; it must stop.
                self.cancel(worker, stream, attempt);
            }
            self.sessions.insert(stream, session);
            self.recovered.push(stream);
        }
        self.recovered.len()
    }

    fn cancel(&self, worker: WorkerId, stream: StreamId, attempt: u32) {
        let nats = self.nats.clone();
        actix::spawn(async move {
            if let Err(e) = nats.cancel(worker, vec![(stream, attempt)]).await {
                warn!(%worker, error = %e, "cannot publish a cancel");
            }
        });
    }

    fn persist(&self, stream: StreamId, record: &StreamRecord) {
        if let Some(store) = &self.store {
            if let Err(e) = store.put_stream(stream, record) {
                warn!(%stream, error = %e, "cannot write a stream record");
            }
        }
    }

    /// Leaves the stream's worker (cancel it there, release it in the registry).
    fn unbind(&mut self, stream: StreamId, cancel: bool) {
        let Some(s) = self.sessions.get_mut(&stream) else {
            return;
        };
        if let Phase::Running(worker) = s.phase {
            let attempt = s.attempt();
            s.phase = Phase::Detached {
                since: Instant::now(),
            };
            s.record.worker = None;
            self.registry.do_send(ReleaseWorker { worker });
            if cancel {
                self.cancel(worker, stream, attempt);
            }
        }
    }

    /// Ends a stream: its record says how, its clients get `update`, it leaves memory.
    fn end(&mut self, stream: StreamId, end: StreamEnd) {
        self.unbind(stream, false);
        let Some(mut s) = self.sessions.remove(&stream) else {
            return;
        };
        let update = match &end {
            StreamEnd::Finished(f) => Update::Finished(f.clone()),
            StreamEnd::Failed(e) => Update::Failed(e.clone()),
        };
        s.record.end = Some(end);
        s.record.ended_at = unix_now();
        self.persist(stream, &s.record);
        s.send(&update);
    }

    fn fail(&mut self, stream: StreamId, kind: ErrorKind, message: String) {
        warn!(%stream, kind = kind.as_str(), %message, "stream failed");
        self.end(stream, StreamEnd::Failed(WireError { kind, message }));
    }

    /// Offers the session's request to workers; the answer comes back to
    /// [`Sessions::dispatched`] (and to `reply`, for a new stream).
    fn dispatch(
        &mut self,
        stream: StreamId,
        avoid: Option<WorkerId>,
        reply: Option<oneshot::Sender<Result<u32, DispatchError>>>,
        ctx: &mut Context<Self>,
    ) {
        let Some(s) = self.sessions.get_mut(&stream) else {
            return;
        };
        s.phase = Phase::Dispatching;
        s.last_progress = Instant::now();
        let req = s.request();
        let attempt = req.attempt;
        let dispatcher = self.dispatcher.clone();
        let exclude: Vec<WorkerId> = avoid.into_iter().collect();
        // A new stream gets one round; a resumed one waits for a worker.
        let deadline = (reply.is_none()).then(|| Instant::now() + self.settings.resume_deadline);
        let fut = async move {
            match deadline {
                Some(deadline) => dispatcher.dispatch_until(&req, exclude, deadline).await,
                None => {
                    let mut exclude = exclude;
                    dispatcher.dispatch(&req, &mut exclude).await
                }
            }
        };
        ctx.spawn(fut.into_actor(self).map(move |result, this, ctx| {
            this.dispatched(stream, attempt, result, reply, ctx);
        }));
    }

    /// Queues a new stream for its model's next submit. The batch goes at once unless a
    /// submit for the model went out less than `max_wait` ago; then it goes when that
    /// submit's reply comes, when `max_wait` has passed since it went out, or when it is
    /// full, whichever is first. (Not "while a submit is in flight": a worker answers
    /// between two engine steps, so a submit stays in flight for most of a step whenever
    /// its worker is busy, and every stream arriving then would wait.)
    fn enqueue(&mut self, model: String, waiting: Waiting, ctx: &mut Context<Self>) {
        let limit = self.nats.max_payload();
        let queue = self.waiting.entry(model.clone()).or_default();
        queue.push(waiting);
        let bytes: usize = queue.iter().map(|w| w.bytes).sum();
        let first = queue.len() == 1;
        let full = queue.len() >= self.settings.max_batch || bytes >= limit;
        let age = self.last_submit.get(&model).map(Instant::elapsed);
        match age {
            Some(age) if age < self.settings.max_wait && !full => {
                if first {
                    ctx.run_later(self.settings.max_wait - age, move |this, ctx| {
                        this.send_batch(model, ctx)
                    });
                }
            }
            _ => self.send_batch(model, ctx),
        }
    }

    /// Sends up to `max_batch` waiting streams of `model` in one submit, as many as fit
    /// in one NATS message (each fits alone: [`Handler<StartStream>`] refuses the others).
    fn send_batch(&mut self, model: String, ctx: &mut Context<Self>) {
        let limit = self.nats.max_payload();
        let Some(queue) = self.waiting.get_mut(&model) else {
            return;
        };
        let mut take = 0;
        let mut bytes = HEADER_BYTES;
        for w in queue.iter().take(self.settings.max_batch) {
            if take > 0 && bytes + w.bytes > limit {
                break;
            }
            bytes += w.bytes;
            take += 1;
        }
        let batch: Vec<Waiting> = queue.drain(..take).collect();
        if queue.is_empty() {
            self.waiting.remove(&model);
        }
        let mut reqs = Vec::with_capacity(batch.len());
        let mut replies = HashMap::with_capacity(batch.len());
        for Waiting { stream, reply, .. } in batch {
            if let Some(s) = self.sessions.get_mut(&stream) {
                s.last_progress = Instant::now();
                reqs.push(s.request());
                replies.insert(stream, reply);
            }
        }
        if reqs.is_empty() {
            return;
        }
        self.last_submit.insert(model.clone(), Instant::now());
        let dispatcher = self.dispatcher.clone();
        let fut = async move { dispatcher.dispatch_batch(reqs).await };
        ctx.spawn(
            fut.into_actor(self)
                .map(move |(worker, results), this, ctx| {
                    for (req, result) in results {
                        let Some(reply) = replies.remove(&req.stream) else {
                            continue;
                        };
                        let elsewhere = match &result {
                            Err(DispatchError::Refused(e)) => {
                                matches!(e.kind, ErrorKind::Overloaded | ErrorKind::Draining)
                            }
                            Err(DispatchError::Submit(e)) => e.worker_lost(),
                            _ => false,
                        };
                        // A batch the server found too large (its headers outgrew the
                        // estimate): each stream alone fits.
                        let alone = matches!(
                            &result,
                            Err(DispatchError::Submit(SubmitError::TooLarge(_)))
                        );
                        if elsewhere || alone {
                            // One more round, one by one, avoiding the worker that refused; with
                            // no other worker, the refusal is the answer.
                            let dispatcher = this.dispatcher.clone();
                            let (stream, attempt) = (req.stream, req.attempt);
                            let fut = async move {
                                let mut exclude: Vec<WorkerId> =
                                    worker.filter(|_| !alone).into_iter().collect();
                                match dispatcher.dispatch(&req, &mut exclude).await {
                                    Err(DispatchError::Route(_)) => result,
                                    other => other,
                                }
                            };
                            ctx.spawn(fut.into_actor(this).map(move |result, this, ctx| {
                                this.dispatched(stream, attempt, result, Some(reply), ctx);
                            }));
                        } else {
                            this.dispatched(req.stream, req.attempt, result, Some(reply), ctx);
                        }
                    }
                    if this.waiting.contains_key(&model) {
                        this.send_batch(model, ctx);
                    }
                }),
        );
    }

    fn dispatched(
        &mut self,
        stream: StreamId,
        attempt: u32,
        result: Result<Bound, DispatchError>,
        reply: Option<oneshot::Sender<Result<u32, DispatchError>>>,
        ctx: &mut Context<Self>,
    ) {
        let current = self
            .sessions
            .get(&stream)
            .is_some_and(|s| s.attempt() == attempt && s.phase == Phase::Dispatching);
        if !current {
            // The stream ended (its events can come before the worker's reply) or moved
            // on meanwhile: whatever still runs of this attempt must stop.
            let answer = match result {
                Ok(bound) => {
                    self.registry.do_send(ReleaseWorker {
                        worker: bound.worker,
                    });
                    self.cancel(bound.worker, stream, attempt);
                    Ok(bound.prompt_tokens)
                }
                Err(e) => Err(e),
            };
            if let Some(reply) = reply {
                let _ = reply.send(answer);
            }
            return;
        }
        match result {
            Ok(bound) => {
                let Some(s) = self.sessions.get_mut(&stream) else {
                    return;
                };
                s.phase = Phase::Running(bound.worker);
                s.prompt_tokens = bound.prompt_tokens;
                s.record.worker = Some(bound.worker);
                s.last_progress = Instant::now();
                let listened = s.listened();
                info!(%stream, worker = %bound.worker, attempt, position = s.tokens.len(), model = %s.record.request.model, prompt_tokens = bound.prompt_tokens, key = %Owner(s.record.owner.as_ref()), "stream accepted");
                let record = s.record.clone();
                let durable = s.durable;
                self.persist(stream, &record);
                if !durable {
                    // The record goes to disk while the worker prefills (after the
                    // submit, not in its way); tokens wait for it only if they come first.
                    self.undurable.push(stream);
                    self.flush(ctx);
                }
                if let Some(reply) = reply {
                    let _ = reply.send(Ok(bound.prompt_tokens));
                }
                if !listened {
                    debug!(%stream, "nobody listens any more; stopping it");
                    self.unbind(stream, true);
                }
            }
            Err(e) => match reply {
                // A new stream: the client gets an HTTP error; nothing to keep.
                Some(reply) => {
                    self.sessions.remove(&stream);
                    if let Some(store) = &self.store {
                        let _ = store.remove_stream(stream);
                    }
                    let _ = reply.send(Err(e));
                }
                None => {
                    let deadline = self.settings.resume_deadline;
                    let model = self
                        .sessions
                        .get(&stream)
                        .map(|s| s.record.request.model.clone())
                        .unwrap_or_default();
                    let wire = e.to_wire();
                    self.fail(
                        stream,
                        wire.kind,
                        format!("no worker for `{model}` could continue the stream within {deadline:?}: {e}"),
                    );
                }
            },
        }
    }

    /// Moves a stream to another worker, from its last checkpointed token.
    fn resume(
        &mut self,
        stream: StreamId,
        avoid: Option<WorkerId>,
        reason: ResumeReason,
        ctx: &mut Context<Self>,
    ) {
        let max = self.settings.max_resumes;
        let Some(s) = self.sessions.get_mut(&stream) else {
            return;
        };
        let why = reason.as_str();
        if reason.counts() {
            if s.resumes >= max {
                let message = format!("the stream was resumed {max} times; giving up ({why})");
                return self.fail(stream, ErrorKind::Internal, message);
            }
            s.resumes += 1;
        }
        self.metrics.resumed(why);
        self.unbind(stream, true);
        let Some(s) = self.sessions.get_mut(&stream) else {
            return;
        };
        s.record.attempt += 1;
        info!(%stream, attempt = s.record.attempt, position = s.tokens.len(), why, "resuming stream");
        let record = s.record.clone();
        self.persist(stream, &record);
        self.dispatch(stream, avoid, None, ctx);
    }

    /// Resumes every stream running on `worker`, elsewhere.
    fn worker_lost(&mut self, worker: WorkerId, reason: ResumeReason, ctx: &mut Context<Self>) {
        let streams: Vec<StreamId> = self
            .sessions
            .iter()
            .filter(|(_, s)| s.phase == Phase::Running(worker))
            .map(|(id, _)| *id)
            .collect();
        if !streams.is_empty() {
            warn!(%worker, streams = streams.len(), why = reason.as_str(), "worker lost; resuming its streams");
        }
        for stream in streams {
            self.resume(stream, Some(worker), reason, ctx);
        }
    }

    /// Checks the events of worker messages; returns the updates for clients, in order,
    /// and appends the tokens to the store.
    fn accept(
        &mut self,
        batches: Vec<TokenBatch>,
        ctx: &mut Context<Self>,
    ) -> Vec<(StreamId, Update)> {
        let mut updates: Vec<(StreamId, Update)> = Vec::new();
        let mut stored: Vec<(StreamId, TokenEvent)> = Vec::new();
        // Streams whose record gained their scored prompt.
        let mut prompts: Vec<StreamId> = Vec::new();
        let mut stop: HashMap<WorkerId, Vec<(StreamId, u32)>> = HashMap::new();
        let mut resume: Vec<(StreamId, Option<WorkerId>, ResumeReason)> = Vec::new();
        let mut ended: HashSet<StreamId> = HashSet::new();
        for batch in batches {
            let worker = batch.worker;
            for event in batch.events {
                let stream = event.stream;
                let terminal = !matches!(event.kind, EventKind::Token(_));
                let Some(s) = self.sessions.get_mut(&stream) else {
                    if !terminal && !ended.contains(&stream) {
                        debug!(%stream, %worker, "event for an unknown stream");
                        stop.entry(worker)
                            .or_default()
                            .push((stream, event.attempt));
                    }
                    continue;
                };
                let live = event.attempt == s.attempt()
                    && match s.phase {
                        Phase::Running(w) => w == worker,
                        Phase::Dispatching => true,
                        Phase::Detached { .. } => false,
                    };
                if !live || resume.iter().any(|(id, _, _)| *id == stream) {
                    if !terminal && event.attempt <= s.attempt() {
                        stop.entry(worker)
                            .or_default()
                            .push((stream, event.attempt));
                    }
                    continue;
                }
                match event.kind {
                    EventKind::Progress(_) => {
                        s.last_progress = Instant::now();
                        updates.push((stream, Update::Progress));
                    }
                    EventKind::Prompt(p) => {
                        s.last_progress = Instant::now();
                        if s.record.prompt.is_none() {
                            s.record.prompt = Some(p.clone());
                            prompts.push(stream);
                            updates.push((stream, Update::Prompt(p)));
                        }
                    }
                    EventKind::Token(mut t) => {
                        // Calls are named after the stream: the same on every attempt. A
                        // call's first piece (the one with its name) carries its id.
                        for call in t.tool_calls.iter_mut().filter(|c| !c.name.is_empty()) {
                            call.id = tool_call_id(stream, call.index);
                        }
                        let next = s.tokens.len() as u32;
                        if t.index < next {
                            continue; // a duplicate
                        }
                        if t.index > next {
                            warn!(%stream, %worker, expected = next, got = t.index, "tokens missing; resuming from the checkpoint");
                            resume.push((stream, None, ResumeReason::TokensMissing));
                            continue;
                        }
                        s.tokens.push(Held {
                            id: t.id,
                            hash: t.hash,
                            text: t.text.clone(),
                            logprobs: t.logprobs.clone(),
                            tool_calls: t.tool_calls.clone(),
                        });
                        s.last_progress = Instant::now();
                        updates.push((
                            stream,
                            Update::Token {
                                index: t.index,
                                text: t.text.clone(),
                                hash: t.hash,
                                logprobs: t.logprobs.clone(),
                                tool_calls: t.tool_calls.clone(),
                            },
                        ));
                        stored.push((stream, t));
                    }
                    EventKind::Finished(f) => {
                        if f.reason == FinishReason::Cancelled
                            || f.completion_tokens as usize != s.tokens.len()
                        {
                            resume.push((stream, None, ResumeReason::EndedEarly));
                            continue;
                        }
                        let f = Finished {
                            prompt_tokens: if f.prompt_tokens > 0 {
                                f.prompt_tokens
                            } else {
                                s.prompt_tokens
                            },
                            ..f
                        };
                        updates.push((stream, Update::Finished(f)));
                        ended.insert(stream);
                    }
                    EventKind::Failed(e) => {
                        if matches!(e.kind, ErrorKind::Internal) {
                            warn!(%stream, %worker, error = %e.message, "worker failed the stream");
                            resume.push((stream, Some(worker), ResumeReason::WorkerFailed));
                        } else if matches!(e.kind, ErrorKind::Draining) {
                            info!(%stream, %worker, "the draining worker handed the stream over");
                            resume.push((stream, Some(worker), ResumeReason::HandedOver));
                        } else {
                            updates.push((stream, Update::Failed(e)));
                            ended.insert(stream);
                        }
                    }
                }
            }
        }
        if let Some(store) = &self.store {
            if let Err(e) = store.append(stored.iter().map(|(s, t)| (*s, t))) {
                warn!(error = %e, "cannot checkpoint tokens");
            }
            for stream in prompts {
                if let Some(s) = self.sessions.get(&stream) {
                    if let Err(e) = store.put_stream(stream, &s.record) {
                        warn!(%stream, error = %e, "cannot checkpoint a scored prompt");
                    }
                }
            }
        }
        for (worker, streams) in stop {
            let nats = self.nats.clone();
            actix::spawn(async move {
                if let Err(e) = nats.cancel(worker, streams).await {
                    warn!(%worker, error = %e, "cannot publish a cancel");
                }
            });
        }
        for (stream, avoid, why) in resume {
            // Tokens accepted before the gap stay; the rest comes from the new attempt.
            updates.retain(|(id, u)| {
                *id != stream || matches!(u, Update::Token { .. } | Update::Prompt(_))
            });
            self.resume(stream, avoid, why, ctx);
        }
        updates
    }

    /// Keeps back (in `pending`) the updates of streams whose record is not on disk
    /// yet; returns the others, in order.
    fn hold_undurable(&mut self, updates: Vec<(StreamId, Update)>) -> Vec<(StreamId, Update)> {
        let (held, ready): (Vec<_>, Vec<_>) = updates
            .into_iter()
            .partition(|(stream, _)| self.sessions.get(stream).is_some_and(|s| !s.durable));
        self.pending.extend(held);
        ready
    }

    /// Sends updates to clients; terminal updates end their streams.
    fn forward(&mut self, updates: Vec<(StreamId, Update)>) {
        let mut lonely: Vec<StreamId> = Vec::new();
        for (stream, update) in updates {
            match update {
                Update::Finished(f) => self.end(stream, StreamEnd::Finished(f)),
                Update::Failed(e) => self.end(stream, StreamEnd::Failed(e)),
                token => {
                    if let Some(s) = self.sessions.get_mut(&stream) {
                        if let Update::Token { index, .. } = &token {
                            s.forwarded = s.forwarded.max(*index as usize + 1);
                        }
                        s.send(&token);
                        if !s.listened() && !lonely.contains(&stream) {
                            lonely.push(stream);
                        }
                    }
                }
            }
        }
        for stream in lonely {
            debug!(%stream, "the client went away; stopping the stream");
            self.unbind(stream, true);
        }
    }

    /// Forgets the streams no client came back to within the reconnect window, and the
    /// oldest detached ones past their bounds: they leave memory and the store, as ended
    /// streams do once the window has passed.
    fn forget_abandoned(&mut self, now: Instant) {
        let s = &self.settings;
        let gone = abandoned(
            &self.sessions,
            now,
            s.reconnect_window,
            s.max_detached,
            s.max_detached_per_key,
        );
        for stream in gone {
            self.sessions.remove(&stream);
            if let Some(store) = &self.store {
                if let Err(e) = store.remove_stream(stream) {
                    warn!(%stream, error = %e, "cannot remove an abandoned stream from the store");
                }
            }
            info!(%stream, "no client came back (reconnect window, or detached streams past their bounds); stream dropped");
        }
        self.metrics.streams_held.set(self.sessions.len() as i64);
    }

    /// Probes stalled streams' workers; moves streams stalled too long.
    fn check_stalls(&mut self, ctx: &mut Context<Self>) {
        let now = Instant::now();
        self.forget_abandoned(now);
        let mut probe: HashSet<WorkerId> = HashSet::new();
        let mut stalled: Vec<(StreamId, WorkerId)> = Vec::new();
        for (id, s) in &self.sessions {
            let Phase::Running(worker) = s.phase else {
                continue;
            };
            let quiet = now.saturating_duration_since(s.last_progress);
            if quiet >= s.stall_window(self.settings.stall_timeout) {
                stalled.push((*id, worker));
            } else if quiet >= self.settings.stall_probe
                && !self.probing.contains(&worker)
                && self
                    .answered
                    .get(&worker)
                    .is_none_or(|t| now.saturating_duration_since(*t) >= self.settings.stall_probe)
            {
                probe.insert(worker);
            }
        }
        for (stream, worker) in stalled {
            self.resume(stream, Some(worker), ResumeReason::Stalled, ctx);
        }
        for worker in probe {
            self.probing.insert(worker);
            let streams: Vec<(StreamId, u32)> = self
                .sessions
                .iter()
                .filter(|(_, s)| s.phase == Phase::Running(worker))
                .map(|(id, s)| (*id, s.attempt()))
                .collect();
            let nats = self.nats.clone();
            let timeout = self.settings.stall_probe.max(Duration::from_millis(500));
            ctx.spawn(
                async move { nats.probe(worker, streams, timeout).await }
                    .into_actor(self)
                    .map(move |result, this, ctx| {
                        this.probing.remove(&worker);
                        match result {
                            Probe::Alive(missing) => {
                                this.answered.insert(worker, Instant::now());
                                for (stream, attempt) in missing {
                                    let still = this.sessions.get(&stream).is_some_and(|s| {
                                        s.phase == Phase::Running(worker) && s.attempt() == attempt
                                    });
                                    if still {
                                        this.resume(stream, None, ResumeReason::LostByWorker, ctx);
                                    }
                                }
                            }
                            Probe::Gone => {
                                this.answered.remove(&worker);
                                this.registry.do_send(ForgetWorker { worker });
                                this.worker_lost(worker, ResumeReason::NoResponders, ctx);
                            }
                            Probe::Unknown => debug!(%worker, "probe unanswered"),
                        }
                    }),
            );
        }
    }

    fn collect(&self) {
        let Some(store) = &self.store else { return };
        let before = unix_now().saturating_sub(self.settings.reconnect_window.as_secs());
        match store.collect(before) {
            Ok(collected) => {
                if collected.removed > 0 {
                    debug!(
                        streams = collected.removed,
                        "collected ended streams from the store"
                    );
                }
                self.metrics.store_streams.set(collected.kept as i64);
            }
            Err(e) => warn!(error = %e, "cannot collect the store"),
        }
    }

    /// Replays a stream that ended and left memory, from the store.
    fn replay_ended(&self, msg: &Attach) -> Result<Attached, AttachError> {
        let (stream, after, subscriber, access) =
            (msg.stream, msg.after, &msg.subscriber, msg.access);
        let store = self.store.as_ref().ok_or(AttachError::Unknown(stream))?;
        let record = store
            .stream(stream)
            .map_err(|e| AttachError::Store(e.to_string()))?
            .filter(|r| access.allows(r.owner.as_ref()))
            .ok_or(AttachError::Unknown(stream))?;
        let Some(end) = &record.end else {
            return Err(AttachError::Unknown(stream));
        };
        // From the client's last position, to check its chain hash there.
        let tokens = store
            .tokens(stream, after.unwrap_or(0))
            .map_err(|e| AttachError::Store(e.to_string()))?;
        if let (None, Some(p)) = (after, &record.prompt) {
            let _ = subscriber.send(Update::Prompt(p.clone()));
        }
        for t in tokens {
            if Some(t.index) == after {
                if msg.after_hash.is_some_and(|h| h != t.hash) {
                    return Err(AttachError::Diverged(stream, t.index));
                }
                continue;
            }
            let _ = subscriber.send(Update::Token {
                index: t.index,
                text: t.text,
                hash: t.hash,
                logprobs: t.logprobs,
                tool_calls: t.tool_calls,
            });
        }
        let (update, prompt_tokens) = match end {
            StreamEnd::Finished(f) => (Update::Finished(f.clone()), f.prompt_tokens),
            StreamEnd::Failed(e) => (Update::Failed(e.clone()), 0),
        };
        let _ = subscriber.send(update);
        Ok(Attached {
            record,
            prompt_tokens,
        })
    }
}

impl Actor for Sessions {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Context<Self>) {
        let tick = (self.settings.stall_probe / 4)
            .clamp(Duration::from_millis(20), Duration::from_millis(250));
        ctx.run_interval(tick, |this, ctx| this.check_stalls(ctx));
        self.collect();
        ctx.run_interval(Duration::from_secs(30), |this, _| this.collect());
        for stream in std::mem::take(&mut self.recovered) {
            info!(%stream, "dispatching a stream recovered from the store");
            if let Some(s) = self.sessions.get_mut(&stream) {
                s.record.attempt += 1;
                let record = s.record.clone();
                self.persist(stream, &record);
            }
            self.dispatch(stream, None, None, ctx);
        }
    }
}

impl Handler<StartStream> for Sessions {
    type Result = MessageResult<StartStream>;

    fn handle(&mut self, msg: StartStream, ctx: &mut Context<Self>) -> Self::Result {
        let (tx, rx) = oneshot::channel();
        // Streams whose clients left wait for a reattach but run nowhere: only live work
        // counts.
        let live = self
            .sessions
            .values()
            .filter(|s| !matches!(s.phase, Phase::Detached { .. }))
            .count();
        if live >= self.settings.max_streams {
            let _ = tx.send(Err(DispatchError::Refused(WireError {
                kind: ErrorKind::Overloaded,
                message: format!("the coordinator runs {live} streams, its limit (max_streams)"),
            })));
            return MessageResult(rx);
        }
        // Every later dispatch of the stream (a resume carries the tokens so far) must fit
        // in one NATS message: a request that cannot is refused now, not failed later.
        let limit = self.nats.max_payload();
        let request = &msg.record.request;
        let bytes = submit_bytes(request, request.params.max_tokens) + HEADER_BYTES_PER_STREAM;
        if bytes + HEADER_BYTES > limit {
            let _ = tx.send(Err(DispatchError::TooLarge { bytes, limit }));
            return MessageResult(rx);
        }
        let model = msg.record.request.model.clone();
        let mut session = Session::new(msg.record, Vec::new());
        session.subscribe(msg.subscriber, 0, None);
        self.persist(msg.stream, &session.record);
        // In `async` mode the record is flushed once a worker takes the stream.
        session.durable =
            !(self.store.is_some() && self.settings.checkpoint == CheckpointMode::Async);
        self.sessions.insert(msg.stream, session);
        if self.settings.max_batch <= 1 {
            self.dispatch(msg.stream, None, Some(tx), ctx);
        } else {
            let waiting = Waiting {
                stream: msg.stream,
                reply: tx,
                bytes,
            };
            self.enqueue(model, waiting, ctx);
        }
        MessageResult(rx)
    }
}

impl Handler<Attach> for Sessions {
    type Result = Result<Attached, AttachError>;

    fn handle(&mut self, msg: Attach, ctx: &mut Context<Self>) -> Self::Result {
        let Some(s) = self.sessions.get_mut(&msg.stream) else {
            let attached = self.replay_ended(&msg);
            if attached.is_ok() {
                self.metrics.reattached.inc();
            }
            return attached;
        };
        if !msg.access.allows(s.record.owner.as_ref()) {
            return Err(AttachError::Unknown(msg.stream));
        }
        // The client's last token must be the stream's: checked now when the session
        // holds it, else when the resumed stream produces it again.
        let mut expect = None;
        if let (Some(after), Some(hash)) = (msg.after, msg.after_hash) {
            match s.tokens.get(after as usize) {
                Some(t) if t.hash != hash => return Err(AttachError::Diverged(msg.stream, after)),
                Some(_) => {}
                None => expect = Some((after, hash)),
            }
        }
        self.metrics.reattached.inc();
        // Tokens not yet flushed reach this client with everyone else's, after the flush.
        let from = msg.after.map_or(0, |a| a as usize + 1);
        if let (0, 1.., Some(p)) = (from, s.forwarded, &s.record.prompt) {
            let _ = msg.subscriber.send(Update::Prompt(p.clone()));
        }
        for i in from..s.forwarded {
            let _ = msg.subscriber.send(s.replay(i));
        }
        // A client ahead of what is forwarded (its tokens were lost with a restarted
        // coordinator's unflushed log) gets only what comes after its own.
        s.subscribe(msg.subscriber, from.max(s.forwarded) as u32, expect);
        s.orphan = false;
        let attached = Attached {
            record: s.record.clone(),
            prompt_tokens: s.prompt_tokens,
        };
        if matches!(s.phase, Phase::Detached { .. }) {
            info!(stream = %msg.stream, position = s.tokens.len(), "a client is back; resuming the stream");
            self.resume(msg.stream, None, ResumeReason::Reattached, ctx);
        }
        Ok(attached)
    }
}

impl Handler<Detach> for Sessions {
    type Result = ();

    fn handle(&mut self, msg: Detach, _: &mut Context<Self>) {
        let Some(s) = self.sessions.get_mut(&msg.stream) else {
            return;
        };
        if !s.listened() {
            debug!(stream = %msg.stream, "the client went away; stopping the stream");
            self.unbind(msg.stream, true);
        }
    }
}

impl Sessions {
    /// Flushes the store, then forwards what was pending when the flush began; starts
    /// the next flush if more arrived meanwhile.
    fn flush(&mut self, ctx: &mut Context<Self>) {
        let Some(store) = self.store.clone() else {
            return;
        };
        if self.flushing || (self.pending.is_empty() && self.undurable.is_empty()) {
            return;
        }
        self.flushing = true;
        let batch = std::mem::take(&mut self.pending);
        let covered = std::mem::take(&mut self.undurable);
        let started = Instant::now();
        ctx.spawn(async move { store.flush().await }.into_actor(self).map(
            move |flushed, this, ctx| {
                this.metrics
                    .checkpoint_flush
                    .observe(started.elapsed().as_secs_f64());
                if let Err(e) = flushed {
                    warn!(error = %e, "checkpoint flush failed");
                }
                this.flushing = false;
                for stream in covered {
                    if let Some(s) = this.sessions.get_mut(&stream) {
                        s.durable = true;
                    }
                }
                this.forward(batch);
                if this.settings.checkpoint == CheckpointMode::Async {
                    // What arrived during the flush for streams now on disk goes out now.
                    let held = std::mem::take(&mut this.pending);
                    let ready = this.hold_undurable(held);
                    this.forward(ready);
                }
                this.flush(ctx);
            },
        ));
    }
}

impl Handler<DispatchTokens> for Sessions {
    type Result = ();

    fn handle(&mut self, msg: DispatchTokens, ctx: &mut Context<Self>) {
        let updates = self.accept(msg.batches, ctx);
        if updates.is_empty() {
            return;
        }
        match (&self.store, self.settings.checkpoint) {
            (Some(_), CheckpointMode::Sync) => {
                // No client sees a token before it is on disk. Batches that arrive
                // during a flush share the next one.
                self.pending.extend(updates);
                self.flush(ctx);
            }
            (Some(_), CheckpointMode::Async) => {
                let ready = self.hold_undurable(updates);
                self.forward(ready);
                self.flush(ctx);
            }
            _ => self.forward(updates),
        }
    }
}

impl Handler<WorkerLost> for Sessions {
    type Result = ();

    fn handle(&mut self, msg: WorkerLost, ctx: &mut Context<Self>) {
        // Nothing is kept of a worker that left: each restart is a new worker id.
        self.answered.remove(&msg.worker);
        self.nats.forget_worker(msg.worker);
        self.worker_lost(msg.worker, ResumeReason::LeftRegistry, ctx);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::validate::Endpoint;
    use baton_common::protocol::{GenParams, PromptSpec};

    fn session(phase: Phase) -> Session {
        let request = SeqRequest {
            stream: StreamId(1),
            model: "m".into(),
            prompt: PromptSpec::Text("hi".into()),
            params: GenParams::greedy(4),
            attempt: 0,
            resume: None,
            max_prompt_tokens: 0,
        };
        let record = StreamRecord {
            request,
            endpoint: Endpoint::Chat,
            include_usage: false,
            created: 0,
            attempt: 0,
            worker: None,
            end: None,
            ended_at: 0,
            owner: None,
            prompt: None,
            choice: 0,
        };
        let held = Held {
            id: 7,
            hash: 1,
            text: "a".into(),
            logprobs: None,
            tool_calls: Vec::new(),
        };
        let mut s = Session::new(record, vec![held]);
        s.phase = phase;
        s
    }

    #[test]
    fn a_client_gets_no_token_twice() {
        let mut s = session(Phase::Running(WorkerId(1)));
        let (fresh, mut fresh_rx) = tokio::sync::mpsc::unbounded_channel();
        let (back, mut back_rx) = tokio::sync::mpsc::unbounded_channel();
        s.subscribe(fresh, 0, None);
        // Reconnected holding positions 0..=2, more than the session has (1 token).
        s.subscribe(back, 3, Some((2, 102)));
        for index in 1..5 {
            s.send(&Update::Token {
                index,
                text: format!("t{index}"),
                hash: 100 + u64::from(index),
                logprobs: None,
                tool_calls: Vec::new(),
            });
        }
        // A resumed attempt sends position 4 again: nobody gets it twice.
        s.send(&Update::Token {
            index: 4,
            text: "t4".into(),
            hash: 104,
            logprobs: None,
            tool_calls: Vec::new(),
        });
        let drain = |rx: &mut tokio::sync::mpsc::UnboundedReceiver<Update>| {
            std::iter::from_fn(|| rx.try_recv().ok())
                .map(|u| match u {
                    Update::Token { index, .. } => index,
                    other => panic!("unexpected {other:?}"),
                })
                .collect::<Vec<_>>()
        };
        assert_eq!(drain(&mut fresh_rx), vec![1, 2, 3, 4]);
        assert_eq!(drain(&mut back_rx), vec![3, 4]);
        assert_eq!(s.subscribers.len(), 2);
    }

    #[test]
    fn a_client_holding_another_text_is_told_and_dropped() {
        let mut s = session(Phase::Running(WorkerId(1)));
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        // The client holds position 2 with a hash the regenerated stream will not have.
        s.subscribe(tx, 3, Some((2, 999)));
        for index in 1..4 {
            s.send(&Update::Token {
                index,
                text: format!("t{index}"),
                hash: 100 + u64::from(index),
                logprobs: None,
                tool_calls: Vec::new(),
            });
        }
        match rx.try_recv() {
            Ok(Update::Failed(e)) => assert_eq!(e.kind, ErrorKind::ChainMismatch),
            other => panic!("expected a chain mismatch, got {other:?}"),
        }
        assert!(rx.try_recv().is_err(), "nothing after the failure");
        assert!(s.subscribers.is_empty());
    }

    #[test]
    fn streams_left_by_their_clients_are_dropped_after_the_window() {
        let window = Duration::from_secs(600);
        let t0 = Instant::now();
        let sessions: HashMap<StreamId, Session> = [
            (StreamId(1), session(Phase::Detached { since: t0 })),
            (
                StreamId(2),
                session(Phase::Detached {
                    since: t0 + Duration::from_secs(300),
                }),
            ),
            (StreamId(3), session(Phase::Running(WorkerId(9)))),
            (StreamId(4), session(Phase::Dispatching)),
        ]
        .into_iter()
        .collect();
        let at = |secs| abandoned(&sessions, t0 + Duration::from_secs(secs), window, 99, 99);
        assert!(at(599).is_empty());
        assert_eq!(at(600), vec![StreamId(1)]);
        let mut late = at(3600);
        late.sort_by_key(|s| s.0);
        assert_eq!(late, vec![StreamId(1), StreamId(2)], "never a live stream");
    }

    #[test]
    fn detached_streams_are_bounded_in_all_and_by_key() {
        let window = Duration::from_secs(600);
        let t0 = Instant::now();
        let (a, b) = (KeyId([1; 32]), KeyId([2; 32]));
        // Stream i left its client at second i: five of key a, three of key b, two
        // without a key; one live stream of key a.
        let owners = [a, a, b, a, b, a, b, a]
            .map(Some)
            .into_iter()
            .chain([None, None]);
        let mut sessions: HashMap<StreamId, Session> = owners
            .enumerate()
            .map(|(i, owner)| {
                let since = t0 + Duration::from_secs(i as u64);
                let mut s = session(Phase::Detached { since });
                s.record.owner = owner;
                (StreamId(i as u128), s)
            })
            .collect();
        let mut live = session(Phase::Running(WorkerId(9)));
        live.record.owner = Some(a);
        sessions.insert(StreamId(99), live);
        let now = t0 + Duration::from_secs(20);
        let sorted = |mut v: Vec<StreamId>| {
            v.sort_by_key(|s| s.0);
            v.into_iter().map(|s| s.0).collect::<Vec<_>>()
        };
        // Two a key: key a keeps its newest two (7, 5), key b its newest two (6, 4).
        let gone = sorted(abandoned(&sessions, now, window, 99, 2));
        assert_eq!(gone, vec![0, 1, 2, 3]);
        // Five in all, newest first: 9, 8, 7, 6, 5.
        let gone = sorted(abandoned(&sessions, now, window, 5, 99));
        assert_eq!(gone, vec![0, 1, 2, 3, 4]);
        // Both: 9, 8 (no key), 7, 6, 5 (a, b, a) — 4 is b's second but past five in all.
        let gone = sorted(abandoned(&sessions, now, window, 5, 2));
        assert_eq!(gone, vec![0, 1, 2, 3, 4]);
        let gone = sorted(abandoned(&sessions, now, window, 6, 2));
        assert_eq!(gone, vec![0, 1, 2, 3]);
    }
}
