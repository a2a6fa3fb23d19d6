//! The worker registry: membership from heartbeats.
//!
//! A worker joins at its first heartbeat and leaves after `worker_timeout_ms` of
//! silence. The registry also counts the streams this coordinator has on each worker, so
//! that the router sees load before the next heartbeat reports it. The logic lives in
//! [`Membership`] (plain data, tested with explicit instants); [`Registry`] is the actor
//! around it.

use std::collections::HashMap;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use actix::{Actor, AsyncContext, Context, Handler, Recipient};
use baton_common::ids::WorkerId;
use baton_common::protocol::Heartbeat;
use tracing::{info, warn};

use super::affinity::PrefixIndex;
use super::messages::{
    CheckHealth, ClusterStatus, ForgetWorker, ListModels, ListWorkers, ReleaseWorker, RouteStream,
    WorkerHeartbeat, WorkerLost,
};
use super::router::{self, RouteError, WorkerLoad};

pub use super::messages::{ClusterView, HealthStatus, LiveWorker, ModelEntry, WorkerView};

/// What a worker last said about itself.
#[derive(Debug, Clone)]
struct WorkerState {
    /// When its last heartbeat arrived.
    last_seen: Instant,
    /// Names of its models (what the router matches).
    model_names: Vec<String>,
    /// Its last heartbeat.
    heartbeat: Heartbeat,
}

/// Membership and load, without the actor.
#[derive(Debug)]
pub struct Membership {
    /// Silence after which a worker is gone.
    timeout: Duration,
    /// Whether any heartbeat ever arrived ("not synced" otherwise).
    synced: bool,
    /// Workers heard from within `timeout` (and some not yet expired).
    workers: HashMap<WorkerId, WorkerState>,
    /// Streams this coordinator runs on each worker now.
    in_flight: HashMap<WorkerId, u32>,
    /// First time each model was seen, for `created` in the models list.
    first_seen: HashMap<String, u64>,
    /// Which workers were sent which prompt prefixes.
    affinity: PrefixIndex,
    /// How the router weighs prefixes against load.
    routing: RoutingSettings,
}

/// How the router weighs a worker's likely cached prefix against its load.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RoutingSettings {
    /// `Some(s)`: prefer the worker that holds the most of a prompt while its load is
    /// at most the least load + `s`; `None`: least loaded only.
    pub affinity_slack: Option<u64>,
    /// Most prompt chunk keys remembered.
    pub affinity_entries: usize,
}

impl Default for RoutingSettings {
    fn default() -> Self {
        Self {
            affinity_slack: Some(4),
            affinity_entries: 1 << 16,
        }
    }
}

impl Membership {
    /// An empty registry whose workers expire after `timeout` of silence.
    pub fn new(timeout: Duration) -> Self {
        Self::with_routing(timeout, RoutingSettings::default())
    }

    /// An empty registry that routes as `routing` says.
    pub fn with_routing(timeout: Duration, routing: RoutingSettings) -> Self {
        Self {
            timeout,
            synced: false,
            workers: HashMap::new(),
            in_flight: HashMap::new(),
            first_seen: HashMap::new(),
            affinity: PrefixIndex::new(routing.affinity_entries),
            routing,
        }
    }

    /// Records a heartbeat received at `now`. Returns whether the worker is new.
    pub fn observe(&mut self, heartbeat: Heartbeat, now: Instant) -> bool {
        self.synced = true;
        let unix = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0);
        for m in &heartbeat.models {
            self.first_seen.entry(m.name.clone()).or_insert(unix);
        }
        let state = WorkerState {
            last_seen: now,
            model_names: heartbeat.models.iter().map(|m| m.name.clone()).collect(),
            heartbeat,
        };
        self.workers.insert(state.heartbeat.worker, state).is_none()
    }

    fn is_live(&self, w: &WorkerState, now: Instant) -> bool {
        now.saturating_duration_since(w.last_seen) < self.timeout
    }

    /// Drops `worker` now; returns whether it was known.
    pub fn forget(&mut self, worker: WorkerId) -> bool {
        self.affinity.forget(worker);
        self.workers.remove(&worker).is_some()
    }

    /// Drops the workers silent for too long at `now`; returns them.
    pub fn expire(&mut self, now: Instant) -> Vec<WorkerId> {
        let gone: Vec<WorkerId> = self
            .workers
            .iter()
            .filter(|(_, w)| !self.is_live(w, now))
            .map(|(id, _)| *id)
            .collect();
        for id in &gone {
            self.workers.remove(id);
            self.affinity.forget(*id);
        }
        gone
    }

    fn live(&self, now: Instant) -> impl Iterator<Item = (&WorkerId, &WorkerState)> {
        self.workers
            .iter()
            .filter(move |(_, w)| self.is_live(w, now))
    }

    /// Picks a worker for `model` and counts one more stream on it.
    pub fn route(
        &mut self,
        model: &str,
        exclude: &[WorkerId],
        now: Instant,
    ) -> Result<WorkerId, RouteError> {
        self.route_many(model, exclude, &[Vec::new()], now)
    }

    /// Picks a worker for streams of `model`, one per entry of `prefixes` (each stream's
    /// [`prefix_keys`](super::affinity::prefix_keys)), counts them on it and records
    /// that it now holds their prefixes.
    pub fn route_many(
        &mut self,
        model: &str,
        exclude: &[WorkerId],
        prefixes: &[Vec<u64>],
        now: Instant,
    ) -> Result<WorkerId, RouteError> {
        let mut cached: HashMap<WorkerId, usize> = HashMap::new();
        if self.routing.affinity_slack.is_some() {
            for keys in prefixes {
                for (worker, n) in self.affinity.matches(keys) {
                    *cached.entry(worker).or_insert(0) += n;
                }
            }
        }
        let loads = self.live(now).map(|(id, w)| WorkerLoad {
            worker: *id,
            models: &w.model_names,
            draining: w.heartbeat.draining,
            capacity: w.heartbeat.capacity,
            running: w.heartbeat.running,
            queued: w.heartbeat.queued,
            in_flight: self.in_flight.get(id).copied().unwrap_or(0),
            kv_used: w.heartbeat.kv_used_bytes,
            kv_budget: w.heartbeat.kv_budget_bytes,
            cached: cached.get(id).copied().unwrap_or(0),
        });
        let picked = router::choose(
            self.synced,
            loads,
            model,
            exclude,
            self.routing.affinity_slack,
        )?;
        let count = prefixes.len().max(1) as u32;
        *self.in_flight.entry(picked).or_insert(0) += count;
        if self.routing.affinity_slack.is_some() {
            for keys in prefixes {
                self.affinity.record(keys, picked);
            }
        }
        Ok(picked)
    }

    /// One stream on `worker` is over.
    pub fn release(&mut self, worker: WorkerId) {
        if let Some(n) = self.in_flight.get_mut(&worker) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                self.in_flight.remove(&worker);
            }
        }
    }

    /// Streams this coordinator has on `worker` now.
    pub fn in_flight(&self, worker: WorkerId) -> u32 {
        self.in_flight.get(&worker).copied().unwrap_or(0)
    }

    /// Every live worker as it last described itself, sorted by id.
    pub fn status(&self, now: Instant) -> ClusterView {
        let mut workers: Vec<WorkerView> = self
            .live(now)
            .map(|(id, w)| WorkerView {
                id: *id,
                models: w.model_names.clone(),
                capacity: w.heartbeat.capacity,
                running: w.heartbeat.running,
                queued: w.heartbeat.queued,
                in_flight: self.in_flight(*id),
                kv_used_bytes: w.heartbeat.kv_used_bytes,
                kv_budget_bytes: w.heartbeat.kv_budget_bytes,
                draining: w.heartbeat.draining,
                version: w.heartbeat.version.clone(),
                last_seen_ms: now.saturating_duration_since(w.last_seen).as_millis() as u64,
            })
            .collect();
        workers.sort_by_key(|w| w.id.0);
        ClusterView {
            synced: self.synced,
            workers,
        }
    }

    /// The models live workers serve, sorted by name.
    pub fn models(&self, now: Instant) -> Vec<ModelEntry> {
        let mut by_name: HashMap<&str, u32> = HashMap::new();
        for (_, w) in self.live(now) {
            for m in &w.heartbeat.models {
                let len = by_name.entry(&m.name).or_insert(0);
                *len = (*len).max(m.context_length);
            }
        }
        let mut list: Vec<ModelEntry> = by_name
            .into_iter()
            .map(|(name, context_length)| ModelEntry {
                id: name.to_string(),
                created: self.first_seen.get(name).copied().unwrap_or(0),
                context_length,
            })
            .collect();
        list.sort_by(|a, b| a.id.cmp(&b.id));
        list
    }

    /// The live workers at `now`, by id.
    pub fn workers(&self, now: Instant) -> Vec<LiveWorker> {
        let mut list: Vec<LiveWorker> = self
            .live(now)
            .map(|(id, w)| LiveWorker {
                heartbeat: w.heartbeat.clone(),
                silent_for: now.saturating_duration_since(w.last_seen),
                in_flight: self.in_flight(*id),
            })
            .collect();
        list.sort_by_key(|w| w.heartbeat.worker);
        list
    }

    /// Whether the cluster can serve at `now`.
    pub fn health(&self, now: Instant) -> HealthStatus {
        if !self.synced {
            return HealthStatus::NotSynced;
        }
        match self.live(now).count() {
            0 => HealthStatus::NoLiveWorkers,
            workers => HealthStatus::Live { workers },
        }
    }
}

/// The registry actor.
pub struct Registry {
    /// Membership and load.
    membership: Membership,
    /// Told when a worker leaves, so that its streams fail instead of hanging.
    on_lost: Option<Recipient<WorkerLost>>,
}

impl Registry {
    /// A registry whose workers expire after `timeout`, routing as `routing` says;
    /// `on_lost` hears of departures.
    pub fn new(
        timeout: Duration,
        routing: RoutingSettings,
        on_lost: Option<Recipient<WorkerLost>>,
    ) -> Self {
        Self {
            membership: Membership::with_routing(timeout, routing),
            on_lost,
        }
    }
}

impl Actor for Registry {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Self::Context) {
        let period = (self.membership.timeout / 4).max(Duration::from_millis(10));
        ctx.run_interval(period, |this, _| {
            for worker in this.membership.expire(Instant::now()) {
                warn!(%worker, "worker silent too long, dropped from the registry");
                if let Some(r) = &this.on_lost {
                    r.do_send(WorkerLost { worker });
                }
            }
        });
    }
}

impl Handler<WorkerHeartbeat> for Registry {
    type Result = ();

    fn handle(&mut self, msg: WorkerHeartbeat, _: &mut Context<Self>) {
        let worker = msg.heartbeat.worker;
        let models: Vec<String> = msg
            .heartbeat
            .models
            .iter()
            .map(|m| m.name.clone())
            .collect();
        if self.membership.observe(msg.heartbeat, Instant::now()) {
            info!(%worker, ?models, "worker joined");
        }
    }
}

impl Handler<RouteStream> for Registry {
    type Result = Result<WorkerId, RouteError>;

    fn handle(&mut self, msg: RouteStream, _: &mut Context<Self>) -> Self::Result {
        self.membership
            .route_many(&msg.model, &msg.exclude, &msg.prefixes, Instant::now())
    }
}

impl Handler<ReleaseWorker> for Registry {
    type Result = ();

    fn handle(&mut self, msg: ReleaseWorker, _: &mut Context<Self>) {
        self.membership.release(msg.worker);
    }
}

impl Handler<ForgetWorker> for Registry {
    type Result = ();

    fn handle(&mut self, msg: ForgetWorker, _: &mut Context<Self>) {
        if self.membership.forget(msg.worker) {
            warn!(worker = %msg.worker, "worker gone (no responders), dropped from the registry");
        }
        if let Some(r) = &self.on_lost {
            r.do_send(WorkerLost { worker: msg.worker });
        }
    }
}

impl Handler<ClusterStatus> for Registry {
    type Result = ClusterView;

    fn handle(&mut self, _: ClusterStatus, _: &mut Context<Self>) -> Self::Result {
        self.membership.status(Instant::now())
    }
}

impl Handler<ListModels> for Registry {
    type Result = Vec<ModelEntry>;

    fn handle(&mut self, _: ListModels, _: &mut Context<Self>) -> Self::Result {
        self.membership.models(Instant::now())
    }
}

impl Handler<ListWorkers> for Registry {
    type Result = Vec<LiveWorker>;

    fn handle(&mut self, _: ListWorkers, _: &mut Context<Self>) -> Self::Result {
        self.membership.workers(Instant::now())
    }
}

impl Handler<CheckHealth> for Registry {
    type Result = HealthStatus;

    fn handle(&mut self, _: CheckHealth, _: &mut Context<Self>) -> Self::Result {
        self.membership.health(Instant::now())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use baton_common::protocol::ModelInfo;

    fn heartbeat(worker: u128, model: &str, running: u32) -> Heartbeat {
        Heartbeat {
            worker: WorkerId(worker),
            models: vec![ModelInfo {
                name: model.into(),
                context_length: 2048,
                fingerprint: 1,
            }],
            capacity: 16,
            running,
            queued: 0,
            kv_used_bytes: 0,
            kv_budget_bytes: 1,
            draining: false,
            version: "test".into(),
        }
    }

    #[test]
    fn not_synced_until_the_first_heartbeat_then_live() {
        let t0 = Instant::now();
        let mut m = Membership::new(Duration::from_secs(3));
        assert_eq!(m.health(t0), HealthStatus::NotSynced);
        assert_eq!(m.route("m", &[], t0), Err(RouteError::NotSynced));
        assert!(m.observe(heartbeat(1, "m", 0), t0));
        assert!(!m.observe(heartbeat(1, "m", 0), t0));
        assert_eq!(m.health(t0), HealthStatus::Live { workers: 1 });
        assert_eq!(m.models(t0)[0].id, "m");
        assert_eq!(m.models(t0)[0].context_length, 2048);
        let workers = m.workers(t0);
        assert_eq!(workers.len(), 1);
        assert_eq!(workers[0].heartbeat.worker, WorkerId(1));
    }

    #[test]
    fn silent_workers_expire_and_leave_no_live_workers() {
        let t0 = Instant::now();
        let timeout = Duration::from_millis(3000);
        let mut m = Membership::new(timeout);
        m.observe(heartbeat(1, "m", 0), t0);
        m.observe(heartbeat(2, "m", 0), t0 + Duration::from_millis(2000));
        let t1 = t0 + Duration::from_millis(2999);
        assert!(m.expire(t1).is_empty());
        // Silence is judged even before the sweep runs.
        let t2 = t0 + timeout;
        assert_eq!(m.health(t2), HealthStatus::Live { workers: 1 });
        assert_eq!(m.route("m", &[], t2), Ok(WorkerId(2)));
        assert_eq!(m.expire(t2), vec![WorkerId(1)]);
        let t3 = t0 + Duration::from_millis(5000);
        assert_eq!(m.expire(t3), vec![WorkerId(2)]);
        assert_eq!(m.health(t3), HealthStatus::NoLiveWorkers);
        assert!(m.models(t3).is_empty());
        assert_eq!(m.route("m", &[], t3), Err(RouteError::NoLiveWorkers));
    }

    #[test]
    fn routing_counts_in_flight_streams_until_released() {
        let t0 = Instant::now();
        let mut m = Membership::new(Duration::from_secs(3));
        m.observe(heartbeat(1, "m", 0), t0);
        m.observe(heartbeat(2, "m", 0), t0);
        let a = m.route("m", &[], t0).expect("a");
        let b = m.route("m", &[], t0).expect("b");
        assert_ne!(a, b);
        assert_eq!((m.in_flight(a), m.in_flight(b)), (1, 1));
        m.release(a);
        m.release(a);
        assert_eq!(m.in_flight(a), 0);
        assert_eq!(m.route("m", &[], t0), Ok(a));
    }

    #[test]
    fn models_are_listed_once_and_sorted() {
        let t0 = Instant::now();
        let mut m = Membership::new(Duration::from_secs(3));
        m.observe(heartbeat(1, "b", 0), t0);
        m.observe(heartbeat(2, "a", 0), t0);
        m.observe(heartbeat(3, "b", 0), t0);
        let ids: Vec<String> = m.models(t0).into_iter().map(|e| e.id).collect();
        assert_eq!(ids, vec!["a", "b"]);
    }

    #[test]
    fn a_prompt_prefix_sticks_to_its_worker_within_the_slack() {
        let t0 = Instant::now();
        let mut m = Membership::with_routing(
            Duration::from_secs(3),
            RoutingSettings {
                affinity_slack: Some(2),
                affinity_entries: 1000,
            },
        );
        m.observe(heartbeat(1, "m", 0), t0);
        m.observe(heartbeat(2, "m", 0), t0);
        let system = vec![11, 12, 13];
        let first = m
            .route_many("m", &[], std::slice::from_ref(&system), t0)
            .expect("a worker");
        // The same prefix follows the first pick while its load is within 2 of the
        // other's; a third stream tips it over (load 3 > 0 + 2).
        for _ in 0..2 {
            assert_eq!(
                m.route_many("m", &[], std::slice::from_ref(&system), t0),
                Ok(first)
            );
        }
        let other = m
            .route_many("m", &[], std::slice::from_ref(&system), t0)
            .expect("a worker");
        assert_ne!(other, first);
        // Once both hold it, load decides.
        assert_eq!(
            m.route_many("m", &[], std::slice::from_ref(&system), t0),
            Ok(other)
        );
        // A worker that leaves takes its prefixes with it.
        m.forget(other);
        assert_eq!(m.route_many("m", &[], &[system], t0), Ok(first));
    }
}
