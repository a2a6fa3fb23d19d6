//! The engine thread: continuous batching over a [`SeqEngine`].
//!
//! The model runs here, never on an actor's event loop. Commands (submit, cancel, drain)
//! arrive on a channel; between two decode steps new sequences join the running batch,
//! cancelled ones leave, and each step's events go out grouped by coordinator, one
//! message per coordinator per step.

use std::{
    collections::{HashMap, VecDeque},
    path::PathBuf,
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
    /// Load a model on a thread of its own (first `check`, which refuses a file before
    /// any memory is spent), self-test it, then serve it between two steps: beside the
    /// models served (`add`), or in their place, their streams finishing on them.
    Load {
        /// The file and the name.
        spec: LoadSpec,
        /// Checks to pass before loading.
        check: Box<dyn FnOnce() -> anyhow::Result<()> + Send + Sync>,
        /// Serve it beside the others.
        add: bool,
        /// What changed, once it serves (or why not).
        reply: tokio::sync::oneshot::Sender<ModelResult>,
    },
    /// Stop serving a model: it takes no new stream; those on it finish.
    Unload {
        /// Its public name.
        name: String,
        /// What changed.
        reply: tokio::sync::oneshot::Sender<ModelResult>,
    },
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
    /// Streams running on models no longer served (replaced or unloaded).
    pub retiring_streams: AtomicU64,
    /// The models served, for the heartbeat.
    pub models: std::sync::Mutex<Vec<ModelInfo>>,
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

    /// The models served now.
    pub fn models(&self) -> Vec<ModelInfo> {
        self.models
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }

    fn set_models(&self, change: ModelChange) {
        *self
            .models
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = change.serving;
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

/// A model file to load, and the name to serve it as.
#[derive(Debug, Clone)]
pub struct LoadSpec {
    /// The GGUF file.
    pub path: PathBuf,
    /// The public name.
    pub name: String,
}

/// Builds an engine for a model file. It runs on a thread of its own, so that the
/// models served go on stepping while another loads.
pub type Loader<E> = Arc<dyn Fn(&LoadSpec) -> anyhow::Result<E> + Send + Sync>;

/// What a load or unload changed.
#[derive(Debug, Clone)]
pub struct ModelChange {
    /// The model loaded.
    pub loaded: Option<ModelInfo>,
    /// The models served now.
    pub serving: Vec<ModelInfo>,
    /// Streams still running on models no longer served.
    pub retiring_streams: u32,
}

/// The answer to [`Command::Load`] or [`Command::Unload`].
pub type ModelResult = Result<ModelChange, WireError>;

/// One model the engine thread serves, with the sequences running on it.
struct Lane<E: SeqEngine> {
    engine: E,
    info: ModelInfo,
    running: Vec<Slot<E::Seq>>,
    queue: VecDeque<Slot<E::Seq>>,
    /// Replaced or unloaded: takes no new stream, and is dropped (its memory freed) once
    /// its last one has ended.
    retiring: bool,
}

impl<E: SeqEngine> Lane<E> {
    fn new(engine: E) -> Self {
        Self {
            info: engine.model_info(),
            engine,
            running: Vec::new(),
            queue: VecDeque::new(),
            retiring: false,
        }
    }

    fn is_empty(&self) -> bool {
        self.running.is_empty() && self.queue.is_empty()
    }

    fn slots(&self) -> impl Iterator<Item = &Slot<E::Seq>> {
        self.running.iter().chain(self.queue.iter())
    }

    fn kv_bytes(&self) -> u64 {
        self.running
            .iter()
            .map(|s| self.engine.kv_bytes(&s.seq))
            .sum()
    }
}

/// A model loaded and self-tested on its own thread, on its way in.
struct Arrival<E> {
    /// Which load ([`Pending`]).
    id: u64,
    engine: anyhow::Result<E>,
}

/// A load under way: where its answer goes, and what it replaces.
struct Pending {
    name: String,
    add: bool,
    reply: tokio::sync::oneshot::Sender<ModelResult>,
}

fn draining_error() -> WireError {
    WireError {
        kind: ErrorKind::Draining,
        message: "the worker is draining".into(),
    }
}

/// The lanes a model loaded as `name` takes the place of: the served one of that
/// name; on a worker serving one model, that one whatever its name; none when `add`.
fn replaced<E: SeqEngine>(lanes: &[Lane<E>], name: &str, add: bool) -> Vec<usize> {
    let live: Vec<usize> = (0..lanes.len()).filter(|&i| !lanes[i].retiring).collect();
    let named: Vec<usize> = live
        .iter()
        .copied()
        .filter(|&i| lanes[i].info.name == name)
        .collect();
    match (add, named.is_empty(), live.len()) {
        (true, _, _) | (false, false, _) => named,
        (false, true, 1) => live,
        (false, true, _) => Vec::new(),
    }
}

/// Generates a few greedy tokens on a model just loaded, before it serves anyone: a
/// model that cannot run fails here, not on a client's request.
pub fn self_test<E: SeqEngine>(engine: &E) -> Result<(), String> {
    let info = engine.model_info();
    let req = SeqRequest {
        stream: StreamId(0),
        model: info.name,
        prompt: baton_common::protocol::PromptSpec::Text("Hello".into()),
        params: baton_common::protocol::GenParams::greedy(4),
        attempt: 0,
        resume: None,
        max_prompt_tokens: 0,
    };
    let mut started = engine
        .start(&req)
        .map_err(|e| format!("self-test: {}", e.message))?;
    // A long prompt would run in chunks; "Hello" takes one step, then a token a step.
    for _ in 0..16 {
        let events = engine
            .step(&mut [&mut started.seq])
            .map_err(|e| format!("self-test: {}", e.message))?;
        for kind in events.into_iter().flatten() {
            match kind {
                EventKind::Finished(_) => return Ok(()),
                EventKind::Failed(e) => return Err(format!("self-test: {}", e.message)),
                _ => {}
            }
        }
    }
    Err("self-test: 4 tokens did not end within 16 steps".into())
}

/// The lanes' names as a list for people.
fn names<E: SeqEngine>(lanes: &[Lane<E>]) -> String {
    let live: Vec<String> = lanes
        .iter()
        .filter(|l| !l.retiring)
        .map(|l| format!("{:?}", l.info.name))
        .collect();
    live.join(", ")
}

fn model_change<E: SeqEngine>(lanes: &[Lane<E>], loaded: Option<ModelInfo>) -> ModelChange {
    ModelChange {
        loaded,
        serving: lanes
            .iter()
            .filter(|l| !l.retiring)
            .map(|l| l.info.clone())
            .collect(),
        retiring_streams: lanes
            .iter()
            .filter(|l| l.retiring)
            .map(|l| l.slots().count() as u32)
            .sum(),
    }
}

fn invalid(message: String) -> WireError {
    WireError {
        kind: ErrorKind::InvalidRequest,
        message,
    }
}

/// Runs until the command channel closes (or, when draining, until the work is done).
/// `loader` builds the engines of later [`Command::Load`]s.
pub fn run<E: SeqEngine + Send + 'static>(
    engine: E,
    loader: Loader<E>,
    limits: Limits,
    commands: mpsc::Receiver<Command>,
    out: tokio::sync::mpsc::UnboundedSender<Outbox>,
    load: Arc<Load>,
) {
    let mut lanes: Vec<Lane<E>> = vec![Lane::new(engine)];
    let (arrivals_tx, arrivals) = mpsc::channel::<Arrival<E>>();
    // Loads under way, by id; a drain answers them at once (their engines, when they
    // come, are dropped).
    let mut pending: HashMap<u64, Pending> = HashMap::new();
    let mut next_load = 0u64;
    // Where admission starts, turning so that no model's queue waits on another's.
    let mut first_lane = 0usize;
    let mut draining = false;
    load.set_models(model_change(&lanes, None));
    loop {
        // Block only when idle; otherwise take what has arrived and go on decoding. A
        // model loading beside is waited for in short naps.
        let idle = lanes.iter().all(Lane::is_empty);
        let first = if idle {
            if draining {
                return;
            }
            if !pending.is_empty() {
                match commands.recv_timeout(std::time::Duration::from_millis(10)) {
                    Ok(c) => Some(c),
                    Err(mpsc::RecvTimeoutError::Timeout) => None,
                    Err(mpsc::RecvTimeoutError::Disconnected) => return,
                }
            } else {
                match commands.recv() {
                    Ok(c) => Some(c),
                    Err(_) => return,
                }
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
                            if lanes.iter().map(|l| l.queue.len()).sum::<usize>()
                                >= limits.max_queued
                            {
                                return refuse(
                                    ErrorKind::Overloaded,
                                    "worker queue is full".into(),
                                );
                            }
                            // A newer attempt of a stream supersedes any older one here.
                            for lane in &mut lanes {
                                lane.running.retain(|x| x.stream != req.stream);
                                lane.queue.retain(|x| x.stream != req.stream);
                            }
                            match start_on_lanes(&mut lanes, coordinator, req) {
                                Ok(prompt_tokens) => SubmitOutcome::Accepted(Accepted {
                                    stream: req.stream,
                                    prompt_tokens,
                                }),
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
                        for lane in &mut lanes {
                            if let Some(i) = lane.running.iter().position(hit) {
                                let slot = lane.running.swap_remove(i);
                                cancelled.push((slot.coordinator, slot.stream, slot.attempt));
                            }
                            if let Some(i) = lane.queue.iter().position(hit) {
                                if let Some(slot) = lane.queue.remove(i) {
                                    cancelled.push((slot.coordinator, slot.stream, slot.attempt));
                                }
                            }
                        }
                    }
                }
                Command::Tokenize { request, reply } => {
                    let answer = match lanes
                        .iter()
                        .find(|l| !l.retiring && l.info.name == request.model)
                    {
                        Some(lane) => lane.engine.tokenize(&request),
                        None => TokenizeReply::Failed(WireError {
                            kind: ErrorKind::UnknownModel,
                            message: format!(
                                "this worker serves {}, not {:?}",
                                names(&lanes),
                                request.model
                            ),
                        }),
                    };
                    let _ = reply.send(answer);
                }
                Command::Drain => {
                    draining = true;
                    for (_, p) in pending.drain() {
                        let _ = p.reply.send(Err(draining_error()));
                    }
                }
                Command::HandOver => {
                    draining = true;
                    for (_, p) in pending.drain() {
                        let _ = p.reply.send(Err(draining_error()));
                    }
                    for lane in &mut lanes {
                        handed_over.extend(
                            lane.running
                                .drain(..)
                                .chain(lane.queue.drain(..))
                                .map(|slot| (slot.coordinator, slot.stream, slot.attempt)),
                        );
                    }
                    if !handed_over.is_empty() {
                        tracing::info!(streams = handed_over.len(), "handing streams over");
                    }
                }
                Command::Load {
                    spec,
                    check,
                    add,
                    reply,
                } => {
                    if draining {
                        let _ = reply.send(Err(draining_error()));
                        continue;
                    }
                    if add
                        && lanes
                            .iter()
                            .any(|l| !l.retiring && l.info.name == spec.name)
                    {
                        let _ = reply.send(Err(invalid(format!(
                            "this worker already serves {:?}: load it without `add` to \
                             replace it",
                            spec.name
                        ))));
                        continue;
                    }
                    if !add && replaced(&lanes, &spec.name, false).is_empty() {
                        let _ = reply.send(Err(invalid(format!(
                            "this worker serves {} and none as {:?}: name the model to \
                             replace, or load it with `add`",
                            names(&lanes),
                            spec.name
                        ))));
                        continue;
                    }
                    let id = next_load;
                    next_load += 1;
                    let loader = loader.clone();
                    let arrivals = arrivals_tx.clone();
                    let name = spec.name.clone();
                    let spawned = std::thread::Builder::new()
                        .name("model-load".into())
                        .spawn(move || {
                            // A panic in a check, the load or the self-test is that
                            // load's failure, not a lost answer.
                            let run = || {
                                check()?;
                                tracing::info!(path = %spec.path.display(), name = %spec.name, "loading a model beside");
                                let engine = loader(&spec)?;
                                self_test(&engine).map_err(anyhow::Error::msg)?;
                                Ok(engine)
                            };
                            let engine = std::panic::catch_unwind(std::panic::AssertUnwindSafe(run))
                                .unwrap_or_else(|panic| {
                                    let why = panic
                                        .downcast_ref::<String>()
                                        .cloned()
                                        .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
                                        .unwrap_or_else(|| "a panic without a message".into());
                                    Err(anyhow::anyhow!("loading {} failed: {why}", spec.path.display()))
                                });
                            let _ = arrivals.send(Arrival { id, engine });
                        });
                    match spawned {
                        Ok(_) => {
                            pending.insert(id, Pending { name, add, reply });
                        }
                        Err(e) => {
                            tracing::error!(error = %e, "cannot spawn a thread to load a model");
                            let _ = reply.send(Err(WireError {
                                kind: ErrorKind::Internal,
                                message: format!("cannot spawn a thread to load the model: {e}"),
                            }));
                        }
                    }
                }
                Command::Unload { name, reply } => {
                    let live = lanes.iter().filter(|l| !l.retiring).count();
                    let answer = match lanes
                        .iter_mut()
                        .find(|l| !l.retiring && l.info.name == name)
                    {
                        None => Err(WireError {
                            kind: ErrorKind::UnknownModel,
                            message: format!("this worker serves {}, not {name:?}", names(&lanes)),
                        }),
                        Some(_) if live == 1 => Err(invalid(format!(
                            "{name:?} is the only model this worker serves: drain the \
                             worker to stop it"
                        ))),
                        Some(lane) => {
                            lane.retiring = true;
                            tracing::info!(model = %name, streams = lane.slots().count(), "model unloaded: its streams finish on it");
                            Ok(model_change(&lanes, None))
                        }
                    };
                    load.set_models(model_change(&lanes, None));
                    let _ = reply.send(answer);
                }
            }
        }
        // Models loaded beside since the last step join between two steps.
        while let Ok(arrival) = arrivals.try_recv() {
            // Already answered (a drain came first): the engine is dropped.
            let Some(p) = pending.remove(&arrival.id) else {
                continue;
            };
            let answer = match arrival.engine {
                Err(e) => {
                    tracing::warn!(error = %format!("{e:#}"), "model not loaded; the models served stay");
                    Err(invalid(format!("{e:#}")))
                }
                Ok(_) if !p.add && replaced(&lanes, &p.name, false).is_empty() => {
                    Err(invalid(format!(
                        "this worker serves {} and none as {:?} any more: nothing to replace",
                        names(&lanes),
                        p.name
                    )))
                }
                Ok(engine) => {
                    let lane = Lane::new(engine);
                    let info = lane.info.clone();
                    for i in replaced(&lanes, &p.name, p.add) {
                        let old = &mut lanes[i];
                        old.retiring = true;
                        tracing::info!(old = %old.info.name, streams = old.slots().count(), "model replaced: its streams finish on it");
                    }
                    tracing::info!(model = %info.name, fingerprint = format!("{:016x}", info.fingerprint), "model loaded and serving");
                    lanes.push(lane);
                    Ok(model_change(&lanes, Some(info)))
                }
            };
            load.set_models(model_change(&lanes, None));
            let _ = p.reply.send(answer);
        }
        // Admit waiting sequences while there is room.
        let mut kv: u64 = lanes.iter().map(Lane::kv_bytes).sum();
        let mut running: usize = lanes.iter().map(|l| l.running.len()).sum();
        let n = lanes.len();
        first_lane = (first_lane + 1) % n.max(1);
        for k in 0..n {
            let lane = &mut lanes[(first_lane + k) % n];
            while running < limits.max_running && (kv < limits.kv_budget || running == 0) {
                match lane.queue.pop_front() {
                    Some(slot) => {
                        kv += lane.engine.kv_bytes(&slot.seq);
                        lane.running.push(slot);
                        running += 1;
                    }
                    None => break,
                }
            }
        }
        // What is held must be known before a long step, not only after it: probes are
        // answered meanwhile.
        load.set_held(
            lanes
                .iter()
                .flat_map(|l| l.slots().map(|s| (s.stream, s.attempt))),
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
        for lane in &mut lanes {
            step_lane(lane, &load, &mut outbox);
        }
        // A replaced model whose last stream has ended goes, and its memory with it.
        let before = lanes.len();
        lanes.retain(|l| !(l.retiring && l.is_empty()));
        if lanes.len() != before {
            tracing::info!(serving = %names(&lanes), "a replaced model's last stream ended; its memory is freed");
            load.set_models(model_change(&lanes, None));
        }
        load.set_held(
            lanes
                .iter()
                .flat_map(|l| l.slots().map(|s| (s.stream, s.attempt))),
        );
        load.running.store(
            lanes.iter().map(|l| l.running.len()).sum::<usize>() as u64,
            Ordering::Relaxed,
        );
        load.queued.store(
            lanes.iter().map(|l| l.queue.len()).sum::<usize>() as u64,
            Ordering::Relaxed,
        );
        load.kv_bytes
            .store(lanes.iter().map(Lane::kv_bytes).sum(), Ordering::Relaxed);
        load.retiring_streams.store(
            lanes
                .iter()
                .filter(|l| l.retiring)
                .map(|l| l.slots().count() as u64)
                .sum(),
            Ordering::Relaxed,
        );
        load.set_prefix(
            lanes
                .iter()
                .map(|l| l.engine.prefix_stats())
                .fold(PrefixStats::default(), PrefixStats::plus),
        );
        if !outbox.is_empty() && out.send(outbox.into_iter().collect()).is_err() {
            return;
        }
    }
}

/// Starts `req` on the model it names: the one served under that name, or, for a
/// resume whose chain that one cannot reproduce, a replaced model of the same name
/// still finishing its streams (the stream began there).
fn start_on_lanes<E: SeqEngine>(
    lanes: &mut [Lane<E>],
    coordinator: CoordinatorId,
    req: &SeqRequest,
) -> Result<u32, WireError> {
    let unknown = || WireError {
        kind: ErrorKind::UnknownModel,
        message: format!("this worker serves {}, not {:?}", names(lanes), req.model),
    };
    // A replaced model of that name, still finishing its streams, started there.
    let on_retiring = || {
        lanes
            .iter()
            .enumerate()
            .rev()
            .filter(|(_, l)| l.retiring && l.info.name == req.model)
            .find_map(|(i, l)| start_slot(&l.engine, coordinator, req).ok().map(|r| (i, r)))
    };
    let live = lanes
        .iter()
        .position(|l| !l.retiring && l.info.name == req.model);
    let (i, (slot, prompt_tokens)) = match live {
        Some(i) => match start_slot(&lanes[i].engine, coordinator, req) {
            Ok(started) => (i, started),
            // A resume the served model cannot reproduce may be one that began on a
            // replaced model.
            Err(e) if e.kind == ErrorKind::ChainMismatch => on_retiring().ok_or(e)?,
            Err(e) => return Err(e),
        },
        // No model of that name is served any more: only a resume may go on, there.
        None if req.resume.is_some() => on_retiring().ok_or_else(unknown)?,
        None => return Err(unknown()),
    };
    lanes[i].queue.push_back(slot);
    Ok(prompt_tokens)
}

/// One decode step of a lane's running sequences; their events go to `outbox`.
fn step_lane<E: SeqEngine>(
    lane: &mut Lane<E>,
    load: &Load,
    outbox: &mut HashMap<CoordinatorId, Vec<StreamEvent>>,
) {
    if lane.running.is_empty() {
        return;
    }
    let running = &mut lane.running;
    let mut seqs: Vec<&mut E::Seq> = running.iter_mut().map(|s| &mut s.seq).collect();
    let began = std::time::Instant::now();
    let stepped = lane.engine.step(&mut seqs);
    if let (Ok(events), true) = (&stepped, tracing::enabled!(tracing::Level::DEBUG)) {
        // Sequences in the step, tokens it gave (fewer while prompts run in chunks) and
        // its time: how a load's steps go, for whoever tunes it.
        let tokens = events
            .iter()
            .flatten()
            .filter(|k| matches!(k, EventKind::Token(_)))
            .count();
        tracing::debug!(
            model = %lane.info.name,
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

#[cfg(test)]
mod tests;
