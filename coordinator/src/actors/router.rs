//! The routing choice: which worker gets a new stream.
//!
//! A pure function over the registry's view, so that it is tested without actors or
//! NATS; the registry calls it while handling
//! [`RouteStream`](super::messages::RouteStream), and counts the pick at once.

use baton_common::ids::WorkerId;

/// What the router knows of one live worker.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WorkerLoad<'a> {
    /// The worker.
    pub worker: WorkerId,
    /// Names of the models it serves.
    pub models: &'a [String],
    /// Taking no new work.
    pub draining: bool,
    /// Most sequences it runs at once.
    pub capacity: u32,
    /// Sequences running at its last heartbeat.
    pub running: u32,
    /// Sequences queued at its last heartbeat.
    pub queued: u32,
    /// Streams this coordinator has on it now (known before its next heartbeat).
    pub in_flight: u32,
    /// KV cache bytes in use at its last heartbeat.
    pub kv_used: u64,
    /// KV cache budget in bytes.
    pub kv_budget: u64,
    /// Leading prompt chunks it likely holds in its prefix cache
    /// ([`super::affinity`]); summed over the streams of a batch.
    pub cached: usize,
}

impl WorkerLoad<'_> {
    /// The load the router minimises.
    pub fn load(&self) -> u64 {
        u64::from(self.running) + u64::from(self.queued) + u64::from(self.in_flight)
    }

    /// KV cache in use, in thousandths of the budget (0 when it has no budget).
    pub fn kv_permille(&self) -> u64 {
        (self.kv_used.min(self.kv_budget).saturating_mul(1000))
            .checked_div(self.kv_budget)
            .unwrap_or(0)
    }

    fn serves(&self, model: &str) -> bool {
        self.models.iter().any(|m| m == model)
    }
}

/// Why no worker was picked.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RouteError {
    /// No heartbeat has ever arrived: the registry cannot tell yet.
    #[error("the coordinator has not heard from any worker yet")]
    NotSynced,
    /// Workers were seen, but none is alive now.
    #[error("no live workers")]
    NoLiveWorkers,
    /// No live worker serves this model.
    #[error("the model `{0}` does not exist")]
    UnknownModel(String),
    /// Workers serve the model, but all are draining (or already refused the request).
    #[error("no worker can take a request for `{0}` now")]
    ModelUnavailable(String),
}

impl RouteError {
    /// A stable identifier for logs and metrics.
    pub fn kind(&self) -> &'static str {
        match self {
            RouteError::NotSynced => "not_synced",
            RouteError::NoLiveWorkers => "no_live_workers",
            RouteError::UnknownModel(_) => "unknown_model",
            RouteError::ModelUnavailable(_) => "model_unavailable",
        }
    }
}

/// Picks a live worker that serves `model`, is not draining and is not in `exclude`.
///
/// Without `affinity_slack` (or when no candidate holds any of the prompt), the least
/// loaded one wins: load is queued + running + this coordinator's in-flight streams;
/// ties go to the worker with less of its KV cache in use, then more free capacity,
/// then the smaller id, so the choice is deterministic.
///
/// With `affinity_slack = Some(s)`, the worker holding the most of the prompt's leading
/// chunks wins among those whose load is at most the least load + `s` (ties by the
/// order above): a shared prefix is reused unless that worker is busier than the
/// least loaded one by more than `s` streams.
pub fn choose<'a>(
    synced: bool,
    workers: impl IntoIterator<Item = WorkerLoad<'a>>,
    model: &str,
    exclude: &[WorkerId],
    affinity_slack: Option<u64>,
) -> Result<WorkerId, RouteError> {
    if !synced {
        return Err(RouteError::NotSynced);
    }
    let mut any_live = false;
    let mut any_serving = false;
    let mut eligible: Vec<WorkerLoad<'a>> = Vec::new();
    for w in workers {
        any_live = true;
        if !w.serves(model) {
            continue;
        }
        any_serving = true;
        if w.draining || exclude.contains(&w.worker) {
            continue;
        }
        eligible.push(w);
    }
    let least = eligible.iter().min_by_key(|w| rank(w)).copied();
    let best = match (least, affinity_slack) {
        (Some(least), Some(slack)) => eligible
            .iter()
            .filter(|w| w.cached > 0 && w.load() <= least.load().saturating_add(slack))
            .min_by_key(|w| (std::cmp::Reverse(w.cached), rank(w)))
            .copied()
            .or(Some(least)),
        (least, _) => least,
    };
    match best {
        Some(w) => Ok(w.worker),
        None if !any_live => Err(RouteError::NoLiveWorkers),
        None if !any_serving => Err(RouteError::UnknownModel(model.to_string())),
        None => Err(RouteError::ModelUnavailable(model.to_string())),
    }
}

/// Sort key: load, then KV cache in use, then free capacity (more is better), then id.
fn rank(w: &WorkerLoad<'_>) -> (u64, u64, i64, WorkerId) {
    let free = i64::from(w.capacity) - w.load() as i64;
    (w.load(), w.kv_permille(), -free, w.worker)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn load(worker: u128, models: &[String], running: u32, in_flight: u32) -> WorkerLoad<'_> {
        WorkerLoad {
            worker: WorkerId(worker),
            models,
            draining: false,
            capacity: 16,
            running,
            queued: 0,
            in_flight,
            kv_used: 0,
            kv_budget: 1 << 30,
            cached: 0,
        }
    }

    #[test]
    fn picks_the_least_loaded_worker_serving_the_model() {
        let m = vec!["m".to_string()];
        let other = vec!["other".to_string()];
        let workers = [load(1, &m, 5, 0), load(2, &m, 1, 1), load(3, &other, 0, 0)];
        assert_eq!(choose(true, workers, "m", &[], None), Ok(WorkerId(2)));
    }

    #[test]
    fn in_flight_streams_spread_requests_between_heartbeats() {
        let m = vec!["m".to_string()];
        let mut in_flight = [0u32, 0];
        let mut picks = Vec::new();
        for _ in 0..4 {
            let workers = [load(1, &m, 0, in_flight[0]), load(2, &m, 0, in_flight[1])];
            let w = choose(true, workers, "m", &[], None).expect("a worker");
            in_flight[(w.0 - 1) as usize] += 1;
            picks.push(w.0);
        }
        assert_eq!(picks, vec![1, 2, 1, 2]);
    }

    #[test]
    fn draining_and_excluded_workers_are_skipped() {
        let m = vec!["m".to_string()];
        let mut a = load(1, &m, 0, 0);
        a.draining = true;
        let b = load(2, &m, 9, 0);
        assert_eq!(choose(true, [a, b], "m", &[], None), Ok(WorkerId(2)));
        assert_eq!(
            choose(true, [a, b], "m", &[WorkerId(2)], None),
            Err(RouteError::ModelUnavailable("m".into()))
        );
    }

    #[test]
    fn ties_prefer_free_capacity_then_the_smaller_id() {
        let m = vec!["m".to_string()];
        let mut big = load(9, &m, 2, 0);
        big.capacity = 64;
        assert_eq!(
            choose(true, [load(1, &m, 2, 0), big], "m", &[], None),
            Ok(WorkerId(9))
        );
        assert_eq!(
            choose(true, [load(5, &m, 2, 0), load(4, &m, 2, 0)], "m", &[], None),
            Ok(WorkerId(4))
        );
    }

    #[test]
    fn errors_say_why() {
        let m = vec!["m".to_string()];
        assert_eq!(
            choose(false, [load(1, &m, 0, 0)], "m", &[], None),
            Err(RouteError::NotSynced)
        );
        assert_eq!(
            choose(true, [], "m", &[], None),
            Err(RouteError::NoLiveWorkers)
        );
        assert_eq!(
            choose(true, [load(1, &m, 0, 0)], "x", &[], None),
            Err(RouteError::UnknownModel("x".into()))
        );
    }

    #[test]
    fn the_worker_holding_the_prefix_wins_within_the_slack() {
        let m = vec!["m".to_string()];
        let mut warm = load(1, &m, 3, 0);
        warm.cached = 5;
        let cold = load(2, &m, 1, 0);
        // Load 3 against 1: within a slack of 2 the warm worker wins; affinity off or a
        // slack of 1, the least loaded one.
        assert_eq!(
            choose(true, [warm, cold], "m", &[], Some(2)),
            Ok(WorkerId(1))
        );
        assert_eq!(
            choose(true, [warm, cold], "m", &[], Some(1)),
            Ok(WorkerId(2))
        );
        assert_eq!(choose(true, [warm, cold], "m", &[], None), Ok(WorkerId(2)));
    }

    #[test]
    fn more_of_the_prefix_beats_less_and_ties_go_by_load() {
        let m = vec!["m".to_string()];
        let mut some = load(1, &m, 0, 0);
        some.cached = 2;
        let mut more = load(2, &m, 2, 0);
        more.cached = 6;
        let mut more_idle = load(3, &m, 1, 0);
        more_idle.cached = 6;
        assert_eq!(
            choose(true, [some, more], "m", &[], Some(4)),
            Ok(WorkerId(2))
        );
        assert_eq!(
            choose(true, [some, more, more_idle], "m", &[], Some(4)),
            Ok(WorkerId(3))
        );
        // A draining or excluded holder is never chosen for its prefix.
        more.draining = true;
        assert_eq!(
            choose(true, [some, more], "m", &[], Some(4)),
            Ok(WorkerId(1))
        );
        assert_eq!(
            choose(true, [some, more_idle], "m", &[WorkerId(3)], Some(4)),
            Ok(WorkerId(1))
        );
    }

    #[test]
    fn equal_load_goes_to_the_emptier_kv_cache() {
        let m = vec!["m".to_string()];
        let mut full = load(1, &m, 2, 0);
        full.kv_used = 900 << 20;
        let mut empty = load(2, &m, 2, 0);
        empty.kv_used = 100 << 20;
        assert_eq!(choose(true, [full, empty], "m", &[], None), Ok(WorkerId(2)));
        assert_eq!(full.kv_permille(), 878);
    }
}
