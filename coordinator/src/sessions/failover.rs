//! Why streams move, and which streams nobody will come back to.

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

use baton_common::ids::{StreamId, WorkerId};
use baton_common::protocol::ErrorKind;
use tracing::{debug, info, warn};

use super::session::{Phase, Session};
use super::table::{Effect, SessionTable};
use crate::auth::KeyId;
use crate::nats::Probe;

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
    pub(super) fn counts(self) -> bool {
        !matches!(self, ResumeReason::HandedOver | ResumeReason::Reattached)
    }
}

/// Streams no client may reattach to any more: those whose last client left at least
/// `window` before `now`, then the oldest detached ones past `max` in all or past
/// `per_key` of one API key.
pub(super) fn abandoned(
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

impl SessionTable {
    /// Moves a stream to another worker, from its last checkpointed token.
    pub(super) fn resume(
        &mut self,
        stream: StreamId,
        avoid: Option<WorkerId>,
        reason: ResumeReason,
    ) {
        let max = self.settings.max_resumes;
        let Some(s) = self.sessions.get_mut(&stream) else {
            return;
        };
        // An end held for a flush is dropped with the resume (see `accept`).
        s.finishing = false;
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
        self.dispatch(stream, avoid, None);
    }

    /// Resumes every stream running on `worker`, elsewhere.
    pub(super) fn worker_lost(&mut self, worker: WorkerId, reason: ResumeReason) {
        let streams: Vec<StreamId> = self
            .sessions
            .iter()
            .filter(|(_, s)| s.runs_on(worker))
            .map(|(id, _)| *id)
            .collect();
        if !streams.is_empty() {
            warn!(%worker, streams = streams.len(), why = reason.as_str(), "worker lost; resuming its streams");
        }
        for stream in streams {
            self.resume(stream, Some(worker), reason);
        }
    }

    /// The registry dropped `worker` (its heartbeats stopped): its streams move.
    pub fn worker_left(&mut self, worker: WorkerId, now: Instant) -> Vec<Effect> {
        self.at(now);
        // Nothing is kept of a worker that left: each restart is a new worker id.
        self.answered.remove(&worker);
        self.out.push(Effect::ForgetSequences(worker));
        self.worker_lost(worker, ResumeReason::LeftRegistry);
        self.effects()
    }

    /// Forgets the streams no client came back to within the reconnect window, and the
    /// oldest detached ones past their bounds: they leave memory and the store, as ended
    /// streams do once the window has passed.
    pub(super) fn forget_abandoned(&mut self) {
        let s = &self.settings;
        let gone = abandoned(
            &self.sessions,
            self.now,
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

    /// The periodic check: abandoned streams go, stalled streams' workers are probed,
    /// and streams stalled past their window move.
    pub fn tick(&mut self, now: Instant) -> Vec<Effect> {
        self.at(now).forget_abandoned();
        let mut probe: HashSet<WorkerId> = HashSet::new();
        let mut stalled: Vec<(StreamId, WorkerId)> = Vec::new();
        for (id, s) in &self.sessions {
            let Phase::Running(worker) = s.phase else {
                continue;
            };
            if s.finishing {
                continue;
            }
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
            self.resume(stream, Some(worker), ResumeReason::Stalled);
        }
        for worker in probe {
            self.probing.insert(worker);
            let streams: Vec<(StreamId, u32)> = self
                .sessions
                .iter()
                .filter(|(_, s)| s.runs_on(worker))
                .map(|(id, s)| (*id, s.attempt()))
                .collect();
            let timeout = self.settings.stall_probe.max(Duration::from_millis(500));
            self.out.push(Effect::Probe {
                worker,
                streams,
                timeout,
            });
        }
        self.effects()
    }

    /// A probe's answer.
    pub fn probed(&mut self, worker: WorkerId, result: Probe, now: Instant) -> Vec<Effect> {
        self.at(now);
        self.probing.remove(&worker);
        match result {
            Probe::Alive(missing) => {
                self.answered.insert(worker, now);
                for (stream, attempt) in missing {
                    let still = self.sessions.get(&stream).is_some_and(|s| {
                        s.phase == Phase::Running(worker) && s.attempt() == attempt
                    });
                    if still {
                        self.resume(stream, None, ResumeReason::LostByWorker);
                    }
                }
            }
            Probe::Gone => {
                self.answered.remove(&worker);
                self.out.push(Effect::Forget(worker));
                self.worker_lost(worker, ResumeReason::NoResponders);
            }
            Probe::Unknown => debug!(%worker, "probe unanswered"),
        }
        self.effects()
    }
}
