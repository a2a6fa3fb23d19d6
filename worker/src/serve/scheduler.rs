//! The engine thread: continuous batching over a [`SeqEngine`].
//!
//! The model runs here, never on an actor's event loop. Commands (submit, cancel, drain)
//! arrive on a channel; between two decode steps new sequences join the running batch,
//! cancelled ones leave, and each step's events go out grouped by coordinator, one
//! message per coordinator per step.

use std::{
    collections::{HashMap, VecDeque},
    sync::{
        atomic::{AtomicU64, Ordering},
        mpsc, Arc,
    },
};

use baton_common::{
    chain::Chain,
    ids::{CoordinatorId, StreamId},
    protocol::{
        Accepted, ErrorKind, EventKind, ModelInfo, Refused, SeqRequest, StreamEvent, SubmitOutcome,
        TokenizeReply, TokenizeRequest, WireError,
    },
};

use crate::engine::prefix::PrefixStats;

/// A sequence an engine started, with the prompt it tokenized.
pub struct Started<S> {
    /// The sequence, ready for its first step (a resumed one has replayed its tokens).
    pub seq: S,
    /// The prompt's token ids: the start of the stream's hash chain.
    pub prompt_ids: Vec<u32>,
}

/// An engine that advances many sequences one token per step.
pub trait SeqEngine {
    /// One sequence's state.
    type Seq;

    /// The model served.
    fn model_info(&self) -> ModelInfo;

    /// Tokenizes and validates a request and starts its sequence. A request with a
    /// [`SeqRequest::resume`] replays the resumed tokens, so that its next step produces
    /// the token after them.
    fn start(&self, req: &SeqRequest) -> Result<Started<Self::Seq>, WireError>;

    /// Advances every sequence by one token; one entry per sequence, in order: the
    /// events it produced (a token, then possibly how it finished). A sequence that is
    /// already finished (a resume that ended with its last replayed token) produces
    /// only its `Finished` event. Token events leave `hash` at 0: the scheduler, which
    /// keeps each sequence's chain, fills it in.
    fn step(&self, seqs: &mut [&mut Self::Seq]) -> Result<Vec<Vec<EventKind>>, WireError>;

    /// Bytes of KV cache a sequence holds.
    fn kv_bytes(&self, seq: &Self::Seq) -> u64;

    /// The prefix cache's counters (zero for an engine without one).
    fn prefix_stats(&self) -> PrefixStats {
        PrefixStats::default()
    }

    /// Token ids of text or messages, or text of ids, with the served model's tokenizer.
    fn tokenize(&self, request: &TokenizeRequest) -> TokenizeReply;
}

/// Refuses a request for `asked` when this worker serves `served` (`None` when they
/// are the same).
pub fn other_model(served: &str, asked: &str) -> Option<WireError> {
    (served != asked).then(|| WireError {
        kind: ErrorKind::UnknownModel,
        message: format!("this worker serves {served:?}, not {asked:?}"),
    })
}

/// What the engine thread is asked to do.
pub enum Command {
    /// New sequences; the outcomes go back on `reply`.
    Submit {
        /// Where the sequences' events go.
        coordinator: CoordinatorId,
        /// The sequences.
        sequences: Vec<SeqRequest>,
        /// One outcome per sequence.
        reply: tokio::sync::oneshot::Sender<Vec<SubmitOutcome>>,
    },
    /// Stop these sequences: each stream's attempts up to the one given.
    Cancel(Vec<(StreamId, u32)>),
    /// Tokenize or detokenize for a client, between steps.
    Tokenize {
        /// What.
        request: TokenizeRequest,
        /// The answer.
        reply: tokio::sync::oneshot::Sender<TokenizeReply>,
    },
    /// Refuse new work from now on.
    Drain,
    /// Drop every sequence held, each with a [`ErrorKind::Draining`] failure: the
    /// coordinator resumes them on other workers. Implies [`Command::Drain`].
    HandOver,
}

/// Load figures the heartbeat reports, updated by the engine thread.
#[derive(Debug, Default)]
pub struct Load {
    /// Sequences in the running batch.
    pub running: AtomicU64,
    /// Sequences waiting for a slot.
    pub queued: AtomicU64,
    /// KV cache bytes in use.
    pub kv_bytes: AtomicU64,
    /// Tokens generated since start.
    pub tokens: AtomicU64,
    /// Sequences that started from cached prefix blocks.
    pub prefix_hits: AtomicU64,
    /// Sequences with a full prompt block that found none cached.
    pub prefix_misses: AtomicU64,
    /// Prompt tokens whose keys and values came from the prefix cache.
    pub prefix_reused_tokens: AtomicU64,
    /// Blocks the prefix cache holds.
    pub prefix_blocks: AtomicU64,
    /// Bytes the prefix cache holds.
    pub prefix_bytes: AtomicU64,
    /// Every (stream, attempt) held, running or queued.
    pub held: std::sync::Mutex<std::collections::HashSet<(StreamId, u32)>>,
}

impl Load {
    /// Whether `stream`'s `attempt` is held here.
    pub fn holds(&self, stream: StreamId, attempt: u32) -> bool {
        self.held
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .contains(&(stream, attempt))
    }

    fn set_prefix(&self, p: PrefixStats) {
        self.prefix_hits.store(p.hits, Ordering::Relaxed);
        self.prefix_misses.store(p.misses, Ordering::Relaxed);
        self.prefix_reused_tokens
            .store(p.reused_tokens, Ordering::Relaxed);
        self.prefix_blocks.store(p.blocks, Ordering::Relaxed);
        self.prefix_bytes.store(p.bytes, Ordering::Relaxed);
    }

    fn set_held<'a>(&self, slots: impl Iterator<Item = (StreamId, u32)> + 'a) {
        let mut held = self
            .held
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        held.clear();
        held.extend(slots);
    }
}

/// Limits of the batch.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// Most sequences running at once.
    pub max_running: usize,
    /// Most sequences waiting.
    pub max_queued: usize,
    /// KV budget in bytes: no new sequence starts while the running ones hold more.
    pub kv_budget: u64,
}

struct Slot<S> {
    coordinator: CoordinatorId,
    stream: StreamId,
    /// The dispatch attempt, echoed in every event.
    attempt: u32,
    /// The stream's hash chain, up to the last token produced.
    chain: Chain,
    seq: S,
}

/// Starts `req` on `engine`, checking a resume's chain hash against this engine's own.
fn start_slot<E: SeqEngine>(
    engine: &E,
    coordinator: CoordinatorId,
    req: &SeqRequest,
) -> Result<(Slot<E::Seq>, u32), WireError> {
    let started = engine.start(req)?;
    let prompt_tokens = u32::try_from(started.prompt_ids.len()).unwrap_or(u32::MAX);
    // The coordinator's limit: the prompt is tokenized but nothing has run yet.
    if req.max_prompt_tokens > 0 && prompt_tokens > req.max_prompt_tokens {
        return Err(WireError {
            kind: ErrorKind::PromptTooLong,
            message: format!(
                "the prompt has {prompt_tokens} tokens, more than this server's limit of {} \
                 (max_prompt_tokens)",
                req.max_prompt_tokens
            ),
        });
    }
    let mut chain = Chain::new(engine.model_info().fingerprint, &started.prompt_ids);
    if let Some(resume) = &req.resume {
        for &t in &resume.tokens {
            chain.push(t);
        }
        if chain.hash() != resume.hash {
            return Err(WireError {
                kind: ErrorKind::ChainMismatch,
                message: format!(
                    "resume of stream {} at position {}: this worker's chain ends at {:016x}, \
                     the checkpoint at {:016x} (another model or prompt)",
                    req.stream,
                    resume.tokens.len(),
                    chain.hash(),
                    resume.hash
                ),
            });
        }
    }
    Ok((
        Slot {
            coordinator,
            stream: req.stream,
            attempt: req.attempt,
            chain,
            seq: started.seq,
        },
        prompt_tokens,
    ))
}

/// Events bound for one coordinator.
pub type Outbox = Vec<(CoordinatorId, Vec<StreamEvent>)>;

/// Runs until the command channel closes (or, when draining, until the work is done).
pub fn run<E: SeqEngine>(
    engine: E,
    limits: Limits,
    commands: mpsc::Receiver<Command>,
    out: tokio::sync::mpsc::UnboundedSender<Outbox>,
    load: Arc<Load>,
) {
    let mut queue: VecDeque<Slot<E::Seq>> = VecDeque::new();
    let mut running: Vec<Slot<E::Seq>> = Vec::new();
    let mut draining = false;
    loop {
        // Block only when idle; otherwise take what has arrived and go on decoding.
        let first = if running.is_empty() && queue.is_empty() {
            if draining {
                return;
            }
            match commands.recv() {
                Ok(c) => Some(c),
                Err(_) => return,
            }
        } else {
            None
        };
        let mut cancelled: Vec<(CoordinatorId, StreamId, u32)> = Vec::new();
        let mut handed_over: Vec<(CoordinatorId, StreamId, u32)> = Vec::new();
        for cmd in first
            .into_iter()
            .chain(std::iter::from_fn(|| commands.try_recv().ok()))
        {
            match cmd {
                Command::Submit {
                    coordinator,
                    sequences,
                    reply,
                } => {
                    let outcomes = sequences
                        .iter()
                        .map(|req| {
                            let refuse = |kind, message: String| {
                                SubmitOutcome::Refused(Refused {
                                    stream: req.stream,
                                    error: WireError { kind, message },
                                })
                            };
                            if draining {
                                return refuse(ErrorKind::Draining, "worker is draining".into());
                            }
                            if queue.len() >= limits.max_queued {
                                return refuse(
                                    ErrorKind::Overloaded,
                                    "worker queue is full".into(),
                                );
                            }
                            // A newer attempt of a stream supersedes any older one here.
                            running.retain(|x| x.stream != req.stream);
                            queue.retain(|x| x.stream != req.stream);
                            match start_slot(&engine, coordinator, req) {
                                Ok((slot, prompt_tokens)) => {
                                    queue.push_back(slot);
                                    SubmitOutcome::Accepted(Accepted {
                                        stream: req.stream,
                                        prompt_tokens,
                                    })
                                }
                                Err(e) => SubmitOutcome::Refused(Refused {
                                    stream: req.stream,
                                    error: e,
                                }),
                            }
                        })
                        .collect();
                    // The coordinator may have given up waiting; nothing to do then.
                    let _ = reply.send(outcomes);
                }
                Command::Cancel(streams) => {
                    for (s, attempt) in streams {
                        let hit = |x: &Slot<E::Seq>| x.stream == s && x.attempt <= attempt;
                        if let Some(i) = running.iter().position(hit) {
                            let slot = running.swap_remove(i);
                            cancelled.push((slot.coordinator, slot.stream, slot.attempt));
                        }
                        if let Some(i) = queue.iter().position(hit) {
                            if let Some(slot) = queue.remove(i) {
                                cancelled.push((slot.coordinator, slot.stream, slot.attempt));
                            }
                        }
                    }
                }
                Command::Tokenize { request, reply } => {
                    let _ = reply.send(engine.tokenize(&request));
                }
                Command::Drain => draining = true,
                Command::HandOver => {
                    draining = true;
                    handed_over.extend(
                        running
                            .drain(..)
                            .chain(queue.drain(..))
                            .map(|slot| (slot.coordinator, slot.stream, slot.attempt)),
                    );
                    if !handed_over.is_empty() {
                        tracing::info!(streams = handed_over.len(), "handing streams over");
                    }
                }
            }
        }
        // Admit waiting sequences while there is room.
        let mut kv: u64 = running.iter().map(|s| engine.kv_bytes(&s.seq)).sum();
        while running.len() < limits.max_running && (kv < limits.kv_budget || running.is_empty()) {
            match queue.pop_front() {
                Some(slot) => {
                    kv += engine.kv_bytes(&slot.seq);
                    running.push(slot);
                }
                None => break,
            }
        }
        // What is held must be known before a long step, not only after it: probes are
        // answered meanwhile.
        load.set_held(
            running
                .iter()
                .chain(queue.iter())
                .map(|s| (s.stream, s.attempt)),
        );
        let mut outbox: HashMap<CoordinatorId, Vec<StreamEvent>> = HashMap::new();
        for (coordinator, stream, attempt) in cancelled {
            outbox.entry(coordinator).or_default().push(StreamEvent {
                stream,
                attempt,
                kind: EventKind::Finished(baton_common::protocol::Finished {
                    reason: baton_common::protocol::FinishReason::Cancelled,
                    prompt_tokens: 0,
                    completion_tokens: 0,
                    cached_tokens: 0,
                }),
            });
        }
        for (coordinator, stream, attempt) in handed_over {
            outbox.entry(coordinator).or_default().push(StreamEvent {
                stream,
                attempt,
                kind: EventKind::Failed(WireError {
                    kind: ErrorKind::Draining,
                    message: "the worker is leaving; the stream moves to another worker".into(),
                }),
            });
        }
        if !running.is_empty() {
            let mut seqs: Vec<&mut E::Seq> = running.iter_mut().map(|s| &mut s.seq).collect();
            let began = std::time::Instant::now();
            let stepped = engine.step(&mut seqs);
            if let (Ok(events), true) = (&stepped, tracing::enabled!(tracing::Level::DEBUG)) {
                // Sequences in the step, tokens it gave (fewer while prompts run in
                // chunks) and its time: how a load's steps go, for whoever tunes it.
                let tokens = events
                    .iter()
                    .flatten()
                    .filter(|k| matches!(k, EventKind::Token(_)))
                    .count();
                tracing::debug!(
                    sequences = seqs.len(),
                    tokens,
                    micros = began.elapsed().as_micros() as u64,
                    "step"
                );
            }
            match stepped {
                Ok(events) => {
                    let mut done = Vec::new();
                    for (i, kinds) in events.into_iter().enumerate() {
                        let slot = &mut running[i];
                        for mut kind in kinds {
                            match &mut kind {
                                EventKind::Token(token) => {
                                    token.hash = slot.chain.push(token.id);
                                    load.tokens.fetch_add(1, Ordering::Relaxed);
                                }
                                EventKind::Finished(_) | EventKind::Failed(_) => done.push(i),
                                EventKind::Prompt(_) | EventKind::Progress(_) => {}
                            }
                            outbox
                                .entry(slot.coordinator)
                                .or_default()
                                .push(StreamEvent {
                                    stream: slot.stream,
                                    attempt: slot.attempt,
                                    kind,
                                });
                        }
                    }
                    done.sort_unstable();
                    done.dedup();
                    for i in done.into_iter().rev() {
                        running.swap_remove(i);
                    }
                }
                Err(error) => {
                    tracing::error!(%error.message, "engine step failed; failing the batch");
                    for slot in running.drain(..) {
                        outbox
                            .entry(slot.coordinator)
                            .or_default()
                            .push(StreamEvent {
                                stream: slot.stream,
                                attempt: slot.attempt,
                                kind: EventKind::Failed(error.clone()),
                            });
                    }
                }
            }
        }
        load.set_held(
            running
                .iter()
                .chain(queue.iter())
                .map(|s| (s.stream, s.attempt)),
        );
        load.running.store(running.len() as u64, Ordering::Relaxed);
        load.queued.store(queue.len() as u64, Ordering::Relaxed);
        load.kv_bytes.store(
            running.iter().map(|s| engine.kv_bytes(&s.seq)).sum(),
            Ordering::Relaxed,
        );
        load.set_prefix(engine.prefix_stats());
        if !outbox.is_empty() && out.send(outbox.into_iter().collect()).is_err() {
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::serve::sim::SimEngine;
    use baton_common::protocol::{GenParams, PromptSpec, Resume, TokenEvent};
    use std::time::Duration;

    fn request(stream: u128, resume: Option<Resume>, attempt: u32) -> SeqRequest {
        SeqRequest {
            stream: StreamId(stream),
            model: "sim".into(),
            prompt: PromptSpec::Text("three word prompt".into()),
            params: GenParams::greedy(6),
            attempt,
            resume,
            max_prompt_tokens: 0,
        }
    }

    struct Harness {
        commands: mpsc::Sender<Command>,
        out: tokio::sync::mpsc::UnboundedReceiver<Outbox>,
    }

    impl Harness {
        fn new() -> Self {
            let (commands, rx) = mpsc::channel();
            let (tx, out) = tokio::sync::mpsc::unbounded_channel();
            let engine = SimEngine::new("sim".into(), Duration::from_millis(1));
            let limits = Limits {
                max_running: 4,
                max_queued: 4,
                kv_budget: u64::MAX,
            };
            std::thread::spawn(move || run(engine, limits, rx, tx, Arc::default()));
            Self { commands, out }
        }

        fn submit(&self, req: SeqRequest) -> SubmitOutcome {
            let (reply, rx) = tokio::sync::oneshot::channel();
            self.commands
                .send(Command::Submit {
                    coordinator: CoordinatorId(1),
                    sequences: vec![req],
                    reply,
                })
                .expect("engine thread");
            rx.blocking_recv().expect("reply").remove(0)
        }

        /// Every event of `stream` until it ends.
        fn drain(&mut self, stream: u128) -> Vec<StreamEvent> {
            let mut got = Vec::new();
            loop {
                let outbox = self.out.blocking_recv().expect("events");
                for (_, events) in outbox {
                    for e in events {
                        if e.stream == StreamId(stream) {
                            let end = !matches!(e.kind, EventKind::Token(_));
                            got.push(e);
                            if end {
                                return got;
                            }
                        }
                    }
                }
            }
        }
    }

    fn tokens(events: &[StreamEvent]) -> Vec<TokenEvent> {
        events
            .iter()
            .filter_map(|e| match &e.kind {
                EventKind::Token(t) => Some(t.clone()),
                _ => None,
            })
            .collect()
    }

    #[test]
    fn prompts_over_max_prompt_tokens_are_refused() {
        let h = Harness::new();
        // The simulated prompt "three word prompt" is three tokens.
        let mut req = request(1, None, 0);
        req.max_prompt_tokens = 2;
        match h.submit(req) {
            SubmitOutcome::Refused(r) => {
                assert_eq!(r.error.kind, ErrorKind::PromptTooLong);
                assert!(
                    r.error.message.contains("max_prompt_tokens"),
                    "{}",
                    r.error.message
                );
            }
            other => panic!("expected a refusal, got {other:?}"),
        }
        let mut req = request(2, None, 0);
        req.max_prompt_tokens = 3;
        assert!(matches!(h.submit(req), SubmitOutcome::Accepted(_)));
    }

    #[test]
    fn tokens_carry_the_chain_and_a_resume_must_match_it() {
        let mut h = Harness::new();
        assert!(matches!(
            h.submit(request(1, None, 0)),
            SubmitOutcome::Accepted(_)
        ));
        let first = tokens(&h.drain(1));
        assert_eq!(first.len(), 6);
        // The hashes are the chain over the prompt's ids, then each token.
        let fingerprint = SimEngine::new("sim".into(), Duration::ZERO)
            .model_info()
            .fingerprint;
        let started = SimEngine::new("sim".into(), Duration::ZERO)
            .start(&request(1, None, 0))
            .map_err(|e| e.message)
            .expect("start");
        let mut chain = Chain::new(fingerprint, &started.prompt_ids);
        for t in &first {
            assert_eq!(t.hash, chain.push(t.id));
        }

        // A resume at position 2 with the right hash goes on from index 2.
        let done: Vec<u32> = first[..2].iter().map(|t| t.id).collect();
        let good = Resume {
            tokens: done.clone(),
            hash: first[1].hash,
        };
        assert!(matches!(
            h.submit(request(2, Some(good), 1)),
            SubmitOutcome::Accepted(_)
        ));
        let events = h.drain(2);
        assert!(events.iter().all(|e| e.attempt == 1));
        let rest = tokens(&events);
        let want: Vec<(u32, u32, u64)> =
            first[2..].iter().map(|t| (t.index, t.id, t.hash)).collect();
        let got: Vec<(u32, u32, u64)> = rest.iter().map(|t| (t.index, t.id, t.hash)).collect();
        assert_eq!(got, want);

        // A wrong hash is refused: another model.
        let bad = Resume {
            tokens: done,
            hash: first[1].hash ^ 1,
        };
        match h.submit(request(3, Some(bad), 1)) {
            SubmitOutcome::Refused(r) => assert_eq!(r.error.kind, ErrorKind::ChainMismatch),
            other => panic!("expected a refusal, got {other:?}"),
        }
    }

    #[test]
    fn a_cancel_spares_a_newer_attempt() {
        let mut h = Harness::new();
        let mut long = request(1, None, 0);
        long.params.max_tokens = 1000;
        assert!(matches!(h.submit(long.clone()), SubmitOutcome::Accepted(_)));
        long.attempt = 1;
        assert!(matches!(h.submit(long), SubmitOutcome::Accepted(_)));
        h.commands
            .send(Command::Cancel(vec![(StreamId(1), 0)]))
            .expect("engine thread");
        h.commands
            .send(Command::Cancel(vec![(StreamId(1), 1)]))
            .expect("engine thread");
        let events = h.drain(1);
        let last = events.last().expect("an end");
        assert_eq!(last.attempt, 1);
        assert!(matches!(last.kind, EventKind::Finished(_)));
        // Attempt 0 was superseded by attempt 1 and produced nothing after it.
        let attempts: Vec<u32> = events.iter().map(|e| e.attempt).collect();
        let first_new = attempts.iter().position(|&a| a == 1).unwrap_or(0);
        assert!(attempts[first_new..].iter().all(|&a| a == 1));
    }

    #[test]
    fn a_hand_over_fails_every_held_stream_as_draining() {
        let mut h = Harness::new();
        // Four long streams (the harness queues at most four between two steps).
        for stream in 1..=4 {
            let mut long = request(stream, None, 0);
            long.params.max_tokens = 1000;
            assert!(matches!(h.submit(long), SubmitOutcome::Accepted(_)));
        }
        h.commands.send(Command::HandOver).expect("engine thread");
        let mut ends: HashMap<StreamId, EventKind> = HashMap::new();
        while ends.len() < 4 {
            let outbox = h.out.blocking_recv().expect("events");
            for e in outbox.into_iter().flat_map(|(_, events)| events) {
                if !matches!(e.kind, EventKind::Token(_)) {
                    assert!(ends.insert(e.stream, e.kind).is_none(), "two ends");
                }
            }
        }
        for (stream, end) in ends {
            match end {
                EventKind::Failed(e) => assert_eq!(e.kind, ErrorKind::Draining),
                other => panic!("stream {stream} ended with {other:?}"),
            }
        }
    }
}
