//! Why streams move, and which streams nobody will come back to.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use baton_common::ids::StreamId;

use super::session::{Phase, Session};
use crate::auth::KeyId;

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
