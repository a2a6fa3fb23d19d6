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
    ids::{CoordinatorId, StreamId},
    protocol::{
        Accepted, ErrorKind, EventKind, ModelInfo, Refused, SeqRequest, StreamEvent, SubmitOutcome,
        WireError,
    },
};

/// An engine that advances many sequences one token per step.
pub trait SeqEngine {
    /// One sequence's state.
    type Seq;

    /// The model served.
    fn model_info(&self) -> ModelInfo;

    /// Tokenizes and validates a request; returns the sequence and its prompt length.
    fn start(&self, req: &SeqRequest) -> Result<(Self::Seq, u32), WireError>;

    /// Advances every sequence by one token; one entry per sequence, in order: the
    /// events it produced (a token, then possibly how it finished).
    fn step(&self, seqs: &mut [&mut Self::Seq]) -> Result<Vec<Vec<EventKind>>, WireError>;

    /// Bytes of KV cache a sequence holds.
    fn kv_bytes(&self, seq: &Self::Seq) -> u64;
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
    /// Stop these sequences.
    Cancel(Vec<StreamId>),
    /// Refuse new work from now on.
    Drain,
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
    seq: S,
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
        let mut cancelled: Vec<(CoordinatorId, StreamId)> = Vec::new();
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
                            match engine.start(req) {
                                Ok((seq, prompt_tokens)) => {
                                    queue.push_back(Slot {
                                        coordinator,
                                        stream: req.stream,
                                        seq,
                                    });
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
                    for s in streams {
                        if let Some(i) = running.iter().position(|x| x.stream == s) {
                            let slot = running.swap_remove(i);
                            cancelled.push((slot.coordinator, slot.stream));
                        }
                        if let Some(i) = queue.iter().position(|x| x.stream == s) {
                            if let Some(slot) = queue.remove(i) {
                                cancelled.push((slot.coordinator, slot.stream));
                            }
                        }
                    }
                }
                Command::Drain => draining = true,
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
        let mut outbox: HashMap<CoordinatorId, Vec<StreamEvent>> = HashMap::new();
        for (coordinator, stream) in cancelled {
            outbox.entry(coordinator).or_default().push(StreamEvent {
                stream,
                kind: EventKind::Finished(baton_common::protocol::Finished {
                    reason: baton_common::protocol::FinishReason::Cancelled,
                    prompt_tokens: 0,
                    completion_tokens: 0,
                }),
            });
        }
        if !running.is_empty() {
            let mut seqs: Vec<&mut E::Seq> = running.iter_mut().map(|s| &mut s.seq).collect();
            match engine.step(&mut seqs) {
                Ok(events) => {
                    let mut done = Vec::new();
                    for (i, kinds) in events.into_iter().enumerate() {
                        let slot = &running[i];
                        for kind in kinds {
                            match &kind {
                                EventKind::Token(_) => {
                                    load.tokens.fetch_add(1, Ordering::Relaxed);
                                }
                                EventKind::Finished(_) | EventKind::Failed(_) => done.push(i),
                            }
                            outbox
                                .entry(slot.coordinator)
                                .or_default()
                                .push(StreamEvent {
                                    stream: slot.stream,
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
                                kind: EventKind::Failed(error.clone()),
                            });
                    }
                }
            }
        }
        load.running.store(running.len() as u64, Ordering::Relaxed);
        load.queued.store(queue.len() as u64, Ordering::Relaxed);
        load.kv_bytes.store(
            running.iter().map(|s| engine.kv_bytes(&s.seq)).sum(),
            Ordering::Relaxed,
        );
        if !outbox.is_empty() && out.send(outbox.into_iter().collect()).is_err() {
            return;
        }
    }
}
