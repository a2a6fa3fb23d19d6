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
}

impl WorkerLoad<'_> {
    /// The load the router minimises.
    pub fn load(&self) -> u64 {
        u64::from(self.running) + u64::from(self.queued) + u64::from(self.in_flight)
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

/// Picks the least loaded live worker that serves `model`, is not draining and is not in
/// `exclude`. Ties go to the worker with more free capacity, then to the smaller id, so
/// the choice is deterministic.
pub fn choose<'a>(
    synced: bool,
    workers: impl IntoIterator<Item = WorkerLoad<'a>>,
    model: &str,
    exclude: &[WorkerId],
) -> Result<WorkerId, RouteError> {
    if !synced {
        return Err(RouteError::NotSynced);
    }
    let mut any_live = false;
    let mut any_serving = false;
    let mut best: Option<WorkerLoad<'a>> = None;
    for w in workers {
        any_live = true;
        if !w.serves(model) {
            continue;
        }
        any_serving = true;
        if w.draining || exclude.contains(&w.worker) {
            continue;
        }
        let better = match &best {
            None => true,
            Some(b) => rank(&w) < rank(b),
        };
        if better {
            best = Some(w);
        }
    }
    match best {
        Some(w) => Ok(w.worker),
        None if !any_live => Err(RouteError::NoLiveWorkers),
        None if !any_serving => Err(RouteError::UnknownModel(model.to_string())),
        None => Err(RouteError::ModelUnavailable(model.to_string())),
    }
}

/// Sort key: load, then free capacity (more is better), then id.
fn rank(w: &WorkerLoad<'_>) -> (u64, i64, WorkerId) {
    let free = i64::from(w.capacity) - w.load() as i64;
    (w.load(), -free, w.worker)
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
        }
    }

    #[test]
    fn picks_the_least_loaded_worker_serving_the_model() {
        let m = vec!["m".to_string()];
        let other = vec!["other".to_string()];
        let workers = [load(1, &m, 5, 0), load(2, &m, 1, 1), load(3, &other, 0, 0)];
        assert_eq!(choose(true, workers, "m", &[]), Ok(WorkerId(2)));
    }

    #[test]
    fn in_flight_streams_spread_requests_between_heartbeats() {
        let m = vec!["m".to_string()];
        let mut in_flight = [0u32, 0];
        let mut picks = Vec::new();
        for _ in 0..4 {
            let workers = [load(1, &m, 0, in_flight[0]), load(2, &m, 0, in_flight[1])];
            let w = choose(true, workers, "m", &[]).expect("a worker");
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
        assert_eq!(choose(true, [a, b], "m", &[]), Ok(WorkerId(2)));
        assert_eq!(
            choose(true, [a, b], "m", &[WorkerId(2)]),
            Err(RouteError::ModelUnavailable("m".into()))
        );
    }

    #[test]
    fn ties_prefer_free_capacity_then_the_smaller_id() {
        let m = vec!["m".to_string()];
        let mut big = load(9, &m, 2, 0);
        big.capacity = 64;
        assert_eq!(
            choose(true, [load(1, &m, 2, 0), big], "m", &[]),
            Ok(WorkerId(9))
        );
        assert_eq!(
            choose(true, [load(5, &m, 2, 0), load(4, &m, 2, 0)], "m", &[]),
            Ok(WorkerId(4))
        );
    }

    #[test]
    fn errors_say_why() {
        let m = vec!["m".to_string()];
        assert_eq!(
            choose(false, [load(1, &m, 0, 0)], "m", &[]),
            Err(RouteError::NotSynced)
        );
        assert_eq!(choose(true, [], "m", &[]), Err(RouteError::NoLiveWorkers));
        assert_eq!(
            choose(true, [load(1, &m, 0, 0)], "x", &[]),
            Err(RouteError::UnknownModel("x".into()))
        );
    }
}
