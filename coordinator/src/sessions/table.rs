//! [`SessionTable`]: every stream's state as plain data. Each method takes an event
//! (a new stream, a client attaching or leaving, worker messages, a dispatch's outcome,
//! a probe's answer, a flush done, a tick) and the time, changes the table, and returns
//! the [`Effect`]s for the actor to run: dispatches, cancels, probes, flushes, timers.
//! Clients' channels are written here directly. Nothing here waits or talks to NATS.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use baton_common::config::CheckpointMode;
use baton_common::ids::{StreamId, WorkerId};
use baton_common::protocol::{
    submit_bytes, tool_call_id, ErrorKind, EventKind, FinishReason, Finished, SeqRequest,
    TokenBatch, TokenEvent, WireError,
};
use tokio::sync::oneshot;
use tracing::{debug, info, warn};

use super::batcher::{
    Batcher, Limits, Queued, Reply, Waiting, HEADER_BYTES, HEADER_BYTES_PER_STREAM,
};
use super::failover::ResumeReason;
use super::messages::{Attach, AttachError, Attached, StartStream};
use super::session::{Held, Phase, Session, Update};
use crate::auth::Owner;
use crate::dispatch::{Bound, DispatchError};
use crate::metrics::Metrics;
use crate::nats::SubmitError;
use crate::store::{Store, StreamEnd, StreamRecord};

/// Failover, batching and retention settings.
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
    /// Largest NATS message (the server's `max_payload`).
    pub max_payload: usize,
}

/// Something for the actor to do.
#[derive(Debug)]
pub enum Effect {
    /// Offer a stream to workers; the outcome goes to [`SessionTable::dispatched`].
    Dispatch(Box<Dispatch>),
    /// Send new streams of one model in one submit; the outcome goes to
    /// [`SessionTable::batch_done`].
    SubmitBatch {
        /// Their model.
        model: String,
        /// Their requests.
        requests: Vec<SeqRequest>,
        /// Their acceptance channels.
        replies: HashMap<StreamId, Reply>,
    },
    /// Tell a worker to stop streams (each up to its attempt).
    Cancel {
        /// The worker.
        worker: WorkerId,
        /// The streams and attempts.
        streams: Vec<(StreamId, u32)>,
    },
    /// One stream fewer runs on a worker.
    Release(WorkerId),
    /// A worker is gone: the registry drops it.
    Forget(WorkerId),
    /// A worker left the registry: its message sequences go.
    ForgetSequences(WorkerId),
    /// Ask a worker whether it holds streams; the answer goes to
    /// [`SessionTable::probed`].
    Probe {
        /// The worker.
        worker: WorkerId,
        /// The streams expected there.
        streams: Vec<(StreamId, u32)>,
        /// How long to wait.
        timeout: Duration,
    },
    /// Flush the store; then [`SessionTable::flushed`].
    Flush(Store),
    /// Call [`SessionTable::wake`] for `model`'s batch after this long.
    Wake {
        /// How long.
        after: Duration,
        /// The model.
        model: String,
    },
}

/// A stream offered to workers.
#[derive(Debug)]
pub struct Dispatch {
    /// The stream.
    pub stream: StreamId,
    /// The attempt this dispatch is.
    pub attempt: u32,
    /// Its request (a resume carries the tokens so far).
    pub request: SeqRequest,
    /// Workers not to offer it to.
    pub exclude: Vec<WorkerId>,
    /// Keep offering until then (a resumed stream); `None`: one round.
    pub deadline: Option<Instant>,
    /// When no worker at all can be found, this is the answer instead (a batch's
    /// refusal, tried once more elsewhere).
    pub fallback: Option<DispatchError>,
    /// A new stream's acceptance channel.
    pub reply: Option<Reply>,
}

/// A flush under way.
#[derive(Debug)]
pub(super) struct InFlush {
    /// Updates that go to clients once it is done.
    pub(super) batch: Vec<(StreamId, Update)>,
    /// Streams whose record it takes to disk.
    pub(super) covered: Vec<StreamId>,
    pub(super) started: Instant,
}

/// Every stream this coordinator holds, and what it is waiting for.
#[derive(Debug)]
pub struct SessionTable {
    pub(super) sessions: HashMap<StreamId, Session>,
    pub(super) settings: SessionSettings,
    pub(super) store: Option<Store>,
    pub(super) metrics: Arc<Metrics>,
    /// Workers with a probe in flight.
    pub(super) probing: HashSet<WorkerId>,
    /// When each worker last answered a probe.
    pub(super) answered: HashMap<WorkerId, Instant>,
    /// Streams to dispatch again once started (recovered from the store).
    pub(super) recovered: Vec<StreamId>,
    /// Updates written to the store, waiting for the next flush (`sync` mode; in
    /// `async` mode, those of streams whose record is not yet on disk).
    pub(super) pending: Vec<(StreamId, Update)>,
    /// Streams whose record the next flush takes to disk (`async` mode).
    pub(super) undurable: Vec<StreamId>,
    /// The flush running; what arrives meanwhile waits for the next one (group commit).
    pub(super) flushing: Option<InFlush>,
    pub(super) batcher: Batcher,
    /// The time of the event being handled.
    pub(super) now: Instant,
    /// Effects of the event being handled.
    pub(super) out: Vec<Effect>,
}

pub(super) fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

impl SessionTable {
    /// No session yet. `store` is `None` when checkpoints are off.
    pub fn new(settings: SessionSettings, store: Option<Store>, metrics: Arc<Metrics>) -> Self {
        Self {
            sessions: HashMap::new(),
            settings,
            store,
            metrics,
            probing: HashSet::new(),
            answered: HashMap::new(),
            recovered: Vec::new(),
            pending: Vec::new(),
            undurable: Vec::new(),
            flushing: None,
            batcher: Batcher::default(),
            now: Instant::now(),
            out: Vec::new(),
        }
    }

    /// Starts handling an event at `now`.
    /// Where checkpoints also go, when JetStream holds them.
    pub fn replica(&self) -> Option<&crate::replica::Replica> {
        self.store.as_ref().and_then(|s| s.replica())
    }

    pub(super) fn at(&mut self, now: Instant) -> &mut Self {
        self.now = now;
        self
    }

    /// The effects of the event handled.
    pub(super) fn effects(&mut self) -> Vec<Effect> {
        std::mem::take(&mut self.out)
    }

    /// Streams held now.
    pub fn len(&self) -> usize {
        self.sessions.len()
    }

    /// Whether no stream is held.
    pub fn is_empty(&self) -> bool {
        self.sessions.is_empty()
    }

    pub(super) fn limits(&self) -> Limits {
        Limits {
            max_batch: self.settings.max_batch,
            max_wait: self.settings.max_wait,
            max_payload: self.settings.max_payload,
        }
    }

    pub(super) fn cancel(&mut self, worker: WorkerId, stream: StreamId, attempt: u32) {
        self.out.push(Effect::Cancel {
            worker,
            streams: vec![(stream, attempt)],
        });
    }

    pub(super) fn persist(&self, stream: StreamId, record: &StreamRecord) {
        if let Some(store) = &self.store {
            if let Err(e) = store.put_stream(stream, record) {
                warn!(%stream, error = %e, "cannot write a stream record");
            }
        }
    }

    /// A new stream: subscribe its client, queue it for a worker, and answer on the
    /// returned channel whether one took it.
    pub fn start(
        &mut self,
        msg: StartStream,
        now: Instant,
    ) -> (oneshot::Receiver<Result<u32, DispatchError>>, Vec<Effect>) {
        self.at(now);
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
            return (rx, self.effects());
        }
        // Every later dispatch of the stream (a resume carries the tokens so far) must fit
        // in one NATS message: a request that cannot is refused now, not failed later.
        let limit = self.settings.max_payload;
        let request = &msg.record.request;
        let bytes = submit_bytes(request, request.params.max_tokens) + HEADER_BYTES_PER_STREAM;
        if bytes + HEADER_BYTES > limit {
            let _ = tx.send(Err(DispatchError::TooLarge { bytes, limit }));
            return (rx, self.effects());
        }
        let model = msg.record.request.model.clone();
        let mut session = Session::new(msg.record, Vec::new(), now);
        session.subscribe(msg.subscriber, 0, None);
        self.persist(msg.stream, &session.record);
        // In `async` mode the record is flushed once a worker takes the stream.
        session.durable =
            !(self.store.is_some() && self.settings.checkpoint == CheckpointMode::Async);
        self.sessions.insert(msg.stream, session);
        if self.settings.max_batch <= 1 {
            self.dispatch(msg.stream, None, Some(tx));
        } else {
            let waiting = Waiting {
                stream: msg.stream,
                reply: tx,
                bytes,
            };
            match self.batcher.push(&model, waiting, now, self.limits()) {
                Queued::SendNow => self.send_batch(&model),
                Queued::WakeAfter(after) => self.out.push(Effect::Wake { after, model }),
                Queued::Wait => {}
            }
        }
        (rx, self.effects())
    }

    /// `model`'s batching window ended.
    pub fn wake(&mut self, model: &str, now: Instant) -> Vec<Effect> {
        self.at(now).send_batch(model);
        self.effects()
    }

    /// Sends the next batch of `model` in one submit.
    pub(super) fn send_batch(&mut self, model: &str) {
        let batch = self.batcher.take(model, self.limits());
        let mut requests = Vec::with_capacity(batch.len());
        let mut replies = HashMap::with_capacity(batch.len());
        for Waiting { stream, reply, .. } in batch {
            if let Some(s) = self.sessions.get_mut(&stream) {
                s.last_progress = self.now;
                requests.push(s.request());
                replies.insert(stream, reply);
            }
        }
        if requests.is_empty() {
            return;
        }
        self.batcher.submitted(model, self.now);
        self.out.push(Effect::SubmitBatch {
            model: model.to_string(),
            requests,
            replies,
        });
    }

    /// A batch's outcome: each stream taken, refused, or tried once more elsewhere.
    pub fn batch_done(
        &mut self,
        model: &str,
        worker: Option<WorkerId>,
        results: Vec<(SeqRequest, Result<Bound, DispatchError>)>,
        mut replies: HashMap<StreamId, Reply>,
        now: Instant,
    ) -> Vec<Effect> {
        self.at(now);
        for (request, result) in results {
            let Some(reply) = replies.remove(&request.stream) else {
                continue;
            };
            let elsewhere = match &result {
                Err(DispatchError::Refused(e)) => {
                    matches!(e.kind, ErrorKind::Overloaded | ErrorKind::Draining)
                }
                Err(DispatchError::Submit(e)) => e.worker_lost(),
                _ => false,
            };
            // A batch the server found too large (its headers outgrew the estimate):
            // each stream alone fits.
            let alone = matches!(
                &result,
                Err(DispatchError::Submit(SubmitError::TooLarge(_)))
            );
            match result {
                // One more round, one by one, avoiding the worker that refused; with no
                // other worker, the refusal is the answer.
                Err(e) if elsewhere || alone => {
                    self.out.push(Effect::Dispatch(Box::new(Dispatch {
                        stream: request.stream,
                        attempt: request.attempt,
                        exclude: worker.filter(|_| !alone).into_iter().collect(),
                        request,
                        deadline: None,
                        fallback: Some(e),
                        reply: Some(reply),
                    })))
                }
                result => self.settle(request.stream, request.attempt, result, Some(reply)),
            }
        }
        if self.batcher.has(model) {
            self.send_batch(model);
        }
        self.effects()
    }

    /// Offers the session's request to workers; the answer comes back to
    /// [`SessionTable::dispatched`] (and to `reply`, for a new stream).
    pub(super) fn dispatch(
        &mut self,
        stream: StreamId,
        avoid: Option<WorkerId>,
        reply: Option<Reply>,
    ) {
        let Some(s) = self.sessions.get_mut(&stream) else {
            return;
        };
        s.phase = Phase::Dispatching;
        s.last_progress = self.now;
        let request = s.request();
        // A new stream gets one round; a resumed one waits for a worker.
        let deadline = reply
            .is_none()
            .then(|| self.now + self.settings.resume_deadline);
        self.out.push(Effect::Dispatch(Box::new(Dispatch {
            stream,
            attempt: request.attempt,
            request,
            exclude: avoid.into_iter().collect(),
            deadline,
            fallback: None,
            reply,
        })));
    }

    /// A dispatch's outcome.
    pub fn dispatched(
        &mut self,
        stream: StreamId,
        attempt: u32,
        result: Result<Bound, DispatchError>,
        reply: Option<Reply>,
        now: Instant,
    ) -> Vec<Effect> {
        self.at(now).settle(stream, attempt, result, reply);
        self.effects()
    }

    pub(super) fn settle(
        &mut self,
        stream: StreamId,
        attempt: u32,
        result: Result<Bound, DispatchError>,
        reply: Option<Reply>,
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
                    self.out.push(Effect::Release(bound.worker));
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
                s.last_progress = self.now;
                let listened = s.listened();
                info!(%stream, worker = %bound.worker, attempt, position = s.tokens.len(), model = %s.record.request.model, prompt_tokens = bound.prompt_tokens, key = %Owner(s.record.owner.as_ref()), "stream accepted");
                let record = s.record.clone();
                let durable = s.durable;
                self.persist(stream, &record);
                if !durable {
                    // The record goes to disk while the worker prefills (after the
                    // submit, not in its way); tokens wait for it only if they come first.
                    self.undurable.push(stream);
                    self.flush();
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
                // A new stream: the client gets an error; nothing to keep.
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

    /// Leaves the stream's worker (cancel it there, release it in the registry).
    pub(super) fn unbind(&mut self, stream: StreamId, cancel: bool) {
        let Some(s) = self.sessions.get_mut(&stream) else {
            return;
        };
        if let Phase::Running(worker) = s.phase {
            let attempt = s.attempt();
            s.phase = Phase::Detached { since: self.now };
            s.record.worker = None;
            self.out.push(Effect::Release(worker));
            if cancel {
                self.cancel(worker, stream, attempt);
            }
        }
    }

    /// Ends a stream: its record says how, its clients get the update, it leaves memory.
    pub(super) fn end(&mut self, stream: StreamId, end: StreamEnd) {
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

    pub(super) fn fail(&mut self, stream: StreamId, kind: ErrorKind, message: String) {
        warn!(%stream, kind = kind.as_str(), %message, "stream failed");
        self.end(stream, StreamEnd::Failed(WireError { kind, message }));
    }

    /// Worker messages: each event is checked against its session (right attempt, next
    /// position), tokens are stored, and clients get them now or after the flush that
    /// takes them (or their stream's record) to disk.
    pub fn tokens(&mut self, batches: Vec<TokenBatch>, now: Instant) -> Vec<Effect> {
        self.at(now);
        let updates = self.accept(batches);
        if updates.is_empty() {
            return self.effects();
        }
        match (&self.store, self.settings.checkpoint) {
            (Some(_), CheckpointMode::Sync) => {
                // No client sees a token before it is on disk. Batches that arrive
                // during a flush share the next one.
                self.pending.extend(updates);
                self.flush();
            }
            (Some(_), CheckpointMode::Async) => {
                let ready = self.hold_undurable(updates);
                self.forward(ready);
                self.flush();
            }
            _ => self.forward(updates),
        }
        self.effects()
    }

    /// Checks the events of worker messages; returns the updates for clients, in order,
    /// and appends the tokens to the store.
    pub(super) fn accept(&mut self, batches: Vec<TokenBatch>) -> Vec<(StreamId, Update)> {
        let now = self.now;
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
                // A stream that is gone or moved on must stop on this worker, whatever it
                // sends (a token, a long prompt's progress), unless it has ended there.
                let terminal = matches!(event.kind, EventKind::Finished(_) | EventKind::Failed(_));
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
                        s.last_progress = now;
                        updates.push((stream, Update::Progress));
                    }
                    EventKind::Prompt(p) => {
                        s.last_progress = now;
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
                        s.last_progress = now;
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
                        s.finishing = true;
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
            self.out.push(Effect::Cancel { worker, streams });
        }
        for (stream, avoid, reason) in resume {
            // Tokens accepted before the gap stay; the rest comes from the new attempt.
            updates.retain(|(id, u)| {
                *id != stream || matches!(u, Update::Token { .. } | Update::Prompt(_))
            });
            self.resume(stream, avoid, reason);
        }
        updates
    }

    /// Sends updates to clients; terminal updates end their streams.
    pub(super) fn forward(&mut self, updates: Vec<(StreamId, Update)>) {
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

    /// A client attaches (reconnects with `Last-Event-ID`): the tokens after its position,
    /// then the live rest; a detached stream resumes.
    pub fn attach(
        &mut self,
        msg: Attach,
        now: Instant,
    ) -> (Result<Attached, AttachError>, Vec<Effect>) {
        self.at(now);
        let Some(s) = self.sessions.get_mut(&msg.stream) else {
            let attached = self.replay_ended(&msg);
            if attached.is_ok() {
                self.metrics.reattached.inc();
            }
            return (attached, self.effects());
        };
        if !msg.access.allows(s.record.owner.as_ref()) {
            return (Err(AttachError::Unknown(msg.stream)), self.effects());
        }
        // The client's last token must be the stream's: checked now when the session
        // holds it, else when the resumed stream produces it again.
        let mut expect = None;
        if let (Some(after), Some(hash)) = (msg.after, msg.after_hash) {
            match s.tokens.get(after as usize) {
                Some(t) if t.hash != hash => {
                    return (
                        Err(AttachError::Diverged(msg.stream, after)),
                        self.effects(),
                    )
                }
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
            self.resume(msg.stream, None, ResumeReason::Reattached);
        }
        (Ok(attached), self.effects())
    }

    /// A client's channel closed: when no client is left, the worker stops.
    pub fn detach(&mut self, stream: StreamId, now: Instant) -> Vec<Effect> {
        self.at(now);
        if let Some(s) = self.sessions.get_mut(&stream) {
            if !s.listened() {
                debug!(%stream, "the client went away; stopping the stream");
                self.unbind(stream, true);
            }
        }
        self.effects()
    }
}
