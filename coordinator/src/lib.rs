//! Baton coordinator: the OpenAI-compatible HTTP front of the cluster.
//!
//! It learns which workers are alive from their heartbeats, routes each request to the
//! least loaded worker serving the model, submits it over NATS, and streams the tokens
//! the worker sends back to the client (Server-Sent Events or one JSON body).
//!
//! # Layout
//! - [`config`]: the command line, merged with `cluster.toml`.
//! - [`auth`]: API keys (constant-time check, key ids for logs), stream ownership and
//!   the per-key stream limit.
//! - [`nats`]: the NATS connection: listeners (heartbeats, tokens), submit, cancel.
//! - [`actors`]: the worker registry with the router's choice.
//! - [`sessions`]: every stream's state as a table (checkpoints, failover, batching,
//!   reconnects) and the actor that runs its effects.
//! - [`dispatch`]: routing and submitting a sequence, with retries on other workers.
//! - [`store`]: the sled checkpoint store.
//! - [`metrics`]: Prometheus metrics (`/metrics`).
//! - [`api`]: what both fronts share: validation, opening streams, reading and shaping
//!   answers, and the one error kind.
//! - [`http`]: the HTTP front: routes, SSE, keys, and the error → status mapping.
//! - [`public`]: the NATS front (completions, replays, admin) in a queue group.
//! - [`fuzz`]: what the `http` fuzz target feeds arbitrary bytes to.
//!
//! [`start`] wires them together inside an actix system; [`run`] also waits for the
//! HTTP server to stop (SIGINT/SIGTERM stop it gracefully).

pub mod actors;
pub mod api;
pub mod auth;
pub mod config;
pub mod dispatch;
pub mod fuzz;
pub mod http;
pub mod metrics;
pub mod nats;
pub mod public;
pub mod replica;
pub mod sessions;
pub mod store;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use actix::{Actor, AsyncContext};
use actix_web::{web, App, HttpServer};
use baton_common::config::ClusterConfig;
use baton_common::ids::CoordinatorId;
use baton_common::subjects::Subjects;
use tracing::{info, warn};

use crate::actors::registry::{Registry, RoutingSettings};
use crate::auth::Keys;
use crate::dispatch::Dispatcher;
use crate::http::AppState;
use crate::metrics::Metrics;
use crate::nats::{Counters, NatsHandle};
use crate::sessions::{NatsLink, SessionSettings, SessionTable, Sessions};
use crate::store::Store;
use baton_common::config::CheckpointMode;

/// Why the coordinator could not start.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    /// NATS is unreachable, refused our credentials, failed TLS, or the NATS settings
    /// contradict each other.
    #[error(transparent)]
    Connect(baton_common::nats::NatsConnectError),
    /// A subscription failed.
    #[error("cannot subscribe: {0}")]
    Subscribe(#[from] async_nats::SubscribeError),
    /// The checkpoint store cannot be opened (held by another coordinator, damaged).
    #[error("cannot open the checkpoint store at {path}: {source}")]
    Store {
        /// Its directory.
        path: String,
        /// Why.
        source: store::StoreError,
    },
    /// `coordinator.jetstream = "on"` and JetStream is missing or refused the set-up.
    #[error("{0}")]
    JetStream(String),
    /// The API keys are unusable (an empty key).
    #[error("invalid API keys: {0}")]
    Keys(#[from] auth::KeyError),
    /// An origin for CORS is not one.
    #[error(transparent)]
    Cors(#[from] http::cors::BadOrigin),
    /// The listen address cannot be bound.
    #[error("cannot listen on {addr}: {source}")]
    Bind {
        /// The address.
        addr: String,
        /// Why.
        source: std::io::Error,
    },
}

/// A started coordinator.
pub struct Running {
    /// Its id (the subject its tokens arrive on).
    pub id: CoordinatorId,
    /// Where the HTTP API listens.
    pub addrs: Vec<SocketAddr>,
    /// Wire error counters.
    pub counters: Arc<Counters>,
    /// Prometheus metrics.
    pub metrics: Arc<Metrics>,
    /// What the public NATS API has taken (malformed requests among it).
    pub public: Arc<public::PublicCounters>,
    /// Stops the HTTP server.
    pub handle: actix_web::dev::ServerHandle,
    /// The HTTP server: it serves only while awaited (or spawned), until shutdown.
    pub server: actix_web::dev::Server,
}

/// Connects to NATS, starts the actors and binds the HTTP server. Must be called
/// inside an actix system (`#[actix_web::main]`, `actix_rt::System`).
pub async fn start(cluster: ClusterConfig) -> Result<Running, StartError> {
    // Settings that can be wrong fail now, before NATS or the store are touched.
    http::cors::check(&cluster.coordinator.cors_origins)?;
    // Contradictory NATS settings fail before anything is opened.
    baton_common::nats::connect_options(&cluster.nats, "baton-coordinator")
        .map_err(|e| StartError::Connect(e.into()))?;
    let settings = &cluster.coordinator;
    let keys = Arc::new(Keys::new(&cluster.auth, settings.max_streams_per_key)?);
    if keys.enabled() {
        for (key, role) in keys.ids() {
            info!(%key, role = role.as_str(), "API key configured");
        }
    } else {
        warn!("no API keys configured: anyone who reaches the HTTP port may use the whole API, admin routes included (set [auth] in cluster.toml, or BATON_API_KEYS and BATON_ADMIN_KEYS)");
    }
    let store = match settings.checkpoint {
        CheckpointMode::Off => None,
        CheckpointMode::Sync | CheckpointMode::Async => {
            let path = settings.store_path.clone();
            let cache_bytes = settings.store_cache_mib.saturating_mul(1 << 20);
            let opened =
                Store::open(std::path::Path::new(&path), cache_bytes).map_err(|source| {
                    StartError::Store {
                        path: path.clone(),
                        source,
                    }
                })?;
            info!(%path, checkpoint = settings.checkpoint.as_str(), streams = opened.len(), "checkpoint store open");
            Some(opened)
        }
    };
    // A restarted coordinator keeps its id, so that its workers' tokens still reach it.
    let id = match &store {
        Some(store) => CoordinatorId(store.coordinator_id(CoordinatorId::random().0).map_err(
            |source| StartError::Store {
                path: settings.store_path.clone(),
                source,
            },
        )?),
        None => CoordinatorId::random(),
    };
    let subjects = Subjects::new(cluster.nats.subject_prefix.clone());
    let nats = NatsHandle::connect(&cluster.nats, subjects, id)
        .await
        .map_err(StartError::Connect)?;
    let store = match store {
        Some(store) => Some(replicate(store, &nats, &cluster.coordinator, id).await?),
        None => None,
    };
    let config = Arc::new(cluster.coordinator);
    // The registry tells the sessions of lost workers and the sessions route through
    // the registry: the sessions' context (and address) exists before either starts.
    let sessions_ctx = actix::Context::<Sessions>::new();
    let registry = Registry::new(
        Duration::from_millis(config.worker_timeout_ms),
        RoutingSettings {
            affinity_slack: config
                .prefix_routing
                .then_some(u64::from(config.prefix_routing_slack)),
            ..RoutingSettings::default()
        },
        Some(sessions_ctx.address().recipient()),
    )
    .start();
    let dispatcher = Dispatcher {
        registry: registry.clone(),
        nats: nats.clone(),
        submit_timeout: Duration::from_millis(config.submit_timeout_ms),
    };
    let metrics = Metrics::new();
    let table = SessionTable::new(
        SessionSettings {
            checkpoint: config.checkpoint,
            reconnect_window: Duration::from_secs(config.reconnect_window_s),
            stall_probe: Duration::from_millis(config.stall_probe_ms.max(10)),
            stall_timeout: Duration::from_millis(config.stall_timeout_ms.max(100)),
            resume_deadline: Duration::from_millis(config.resume_deadline_ms),
            max_resumes: config.max_resumes,
            max_batch: config.max_batch.max(1) as usize,
            max_wait: Duration::from_millis(config.max_wait_ms),
            max_streams: config.max_streams.max(1) as usize,
            max_detached: config.max_detached_streams as usize,
            max_detached_per_key: config.max_detached_per_key as usize,
            max_payload: nats.max_payload(),
        },
        store,
        metrics.clone(),
    );
    let replica = table.replica().cloned();
    let mut sessions = Sessions::new(table, std::rc::Rc::new(NatsLink::new(dispatcher)));
    let recovered = sessions.recover();
    if recovered > 0 {
        info!(
            streams = recovered,
            "unfinished streams found in the store; dispatching them again"
        );
    }
    let sessions = sessions_ctx.run(sessions);
    if let Some(replica) = replica {
        actix::spawn(take_over(
            replica,
            sessions.clone(),
            Duration::from_secs(config.reconnect_window_s),
        ));
    }
    nats.listen(registry.clone().recipient(), sessions.clone().recipient())
        .await?;
    // One tokens/s sample a second, for the status page.
    {
        let metrics = metrics.clone();
        actix::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_secs(1));
            let mut last = std::time::Instant::now();
            loop {
                tick.tick().await;
                let unix = std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map(|d| d.as_secs())
                    .unwrap_or(0);
                metrics.sample(unix, last.elapsed().as_secs_f64());
                last = std::time::Instant::now();
            }
        });
    }
    let public = public::PublicApi::new(
        nats.clone(),
        config.clone(),
        registry.clone(),
        sessions.clone(),
    );
    public.serve().await?;
    let state = AppState {
        config: config.clone(),
        keys,
        registry,
        sessions,
        nats: nats.clone(),
        metrics: metrics.clone(),
        public: public.counters().clone(),
    };
    let data = web::Data::new(state);
    let cors_origins = config.cors_origins.clone();
    let clients = http::clients::ClientTable::new(config.max_connections_per_client as usize);
    let server = HttpServer::new(move || {
        App::new()
            .app_data(data.clone())
            .wrap(actix_web::middleware::from_fn(http::auth::check))
            // Before the key check: a connection past its address's limit is served
            // nothing.
            .wrap(actix_web::middleware::from_fn(http::clients::check))
            // Outside the key check: its refusals carry the request's id too.
            .wrap(actix_web::middleware::from_fn(http::request_id::echo))
            // Outermost: preflights are answered before the key check.
            .wrap(actix_web::middleware::Condition::new(
                !cors_origins.is_empty(),
                http::cors::middleware(&cors_origins),
            ))
            .configure(http::routes::configure)
            .default_service(web::to(http::routes::not_found))
    })
    // Streamed answers are many small writes: with Nagle's algorithm on, a token's chunk
    // waits for the client's (delayed) acknowledgement of the one before, and a first
    // token could reach its client only with the second.
    .on_connect(move |conn, data| {
        if let Some(tcp) = conn.downcast_ref::<actix_web::rt::net::TcpStream>() {
            if let Err(e) = tcp.set_nodelay(true) {
                warn!(error = %e, "cannot set TCP_NODELAY on a client connection");
            }
            if let Ok(peer) = tcp.peer_addr() {
                data.insert(clients.connect(peer.ip()));
            }
        }
    })
    .bind(config.listen.as_str())
    .map_err(|source| StartError::Bind {
        addr: config.listen.clone(),
        source,
    })?;
    let addrs = server.addrs();
    let server = server.run();
    let handle = server.handle();
    info!(coordinator = %id, ?addrs, "coordinator listening");
    Ok(Running {
        id,
        addrs,
        counters: nats.counters().clone(),
        metrics,
        public: public.counters().clone(),
        handle,
        server,
    })
}

/// Runs the coordinator until the HTTP server stops.
pub async fn run(cluster: ClusterConfig) -> Result<(), RunError> {
    let running = start(cluster).await?;
    running.server.await.map_err(RunError::Server)?;
    info!("coordinator stopped");
    Ok(())
}

/// Why the coordinator stopped with an error.
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    /// It could not start.
    #[error(transparent)]
    Start(#[from] StartError),
    /// The HTTP server failed.
    #[error("HTTP server failed: {0}")]
    Server(std::io::Error),
}

/// How long a coordinator waits for JetStream to take its buckets at start.
const JETSTREAM_SETUP: Duration = Duration::from_secs(30);

/// Sends `store`'s writes to JetStream too, as `settings.jetstream` asks and the NATS
/// server allows.
async fn replicate(
    store: Store,
    nats: &NatsHandle,
    settings: &baton_common::config::CoordinatorConfig,
    id: CoordinatorId,
) -> Result<Store, StartError> {
    use baton_common::config::JetStreamMode;
    let info = nats.client().server_info();
    let required = match settings.jetstream {
        JetStreamMode::Off => return Ok(store),
        JetStreamMode::On => true,
        JetStreamMode::Auto => false,
    };
    if !info.jetstream {
        if required {
            return Err(StartError::JetStream(
                "coordinator.jetstream = \"on\" but the NATS server runs without JetStream (start nats-server with -js)".into(),
            ));
        }
        info!("the NATS server runs without JetStream: checkpoints stay in the local store alone");
        return Ok(store);
    }
    // Every server of the cluster advertises the client URLs of all of them.
    let servers = info.connect_urls.len().max(1);
    let replicas = match settings.jetstream_replicas {
        0 => servers.min(3),
        n => n as usize,
    };
    let replica_settings = replica::ReplicaSettings {
        replicas,
        lease: Duration::from_millis(settings.lease_ms.max(100)),
        max_age: Duration::from_secs(settings.reconnect_window_s.saturating_add(86_400)),
    };
    // A NATS cluster that has just started may not have placed JetStream's peers yet
    // ("no suitable peers for placement"): try for a while before giving up.
    let deadline = std::time::Instant::now() + JETSTREAM_SETUP;
    let opened = loop {
        let opened = replica::Replica::open(
            nats.client().clone(),
            nats.subjects().clone(),
            id,
            replica_settings,
        )
        .await;
        match opened {
            Err(e) if std::time::Instant::now() < deadline => {
                warn!(error = %e, "JetStream is not ready for the checkpoints yet; trying again");
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
            opened => break opened,
        }
    };
    match opened {
        Ok(replica) => {
            // Streams taken over by others while this coordinator was down are theirs.
            let mut dropped = 0;
            for (stream, _) in store.unfinished().unwrap_or_default() {
                if let Ok(Some(found)) = replica.lookup(stream).await {
                    if found.owner != id && store.remove_local(stream).is_ok() {
                        dropped += 1;
                    }
                }
            }
            if dropped > 0 {
                info!(streams = dropped, "unfinished streams of the store were taken over by other coordinators meanwhile; left to them");
            }
            Ok(store.with_replica(replica))
        }
        Err(e) if required => Err(StartError::JetStream(e.to_string())),
        Err(e) => {
            warn!(error = %e, "checkpoints stay in the local store alone");
            Ok(store)
        }
    }
}

/// Takes over the unfinished streams of dead coordinators, for as long as this one runs:
/// looks whenever a lease ran out, and once a minute.
async fn take_over(replica: replica::Replica, sessions: actix::Addr<Sessions>, window: Duration) {
    let mut tick = tokio::time::interval(replica.lease() / 2);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut last = None::<std::time::Instant>;
    loop {
        tick.tick().await;
        // Owners never seen alive count as dead only a lease after the first poll.
        if !replica.settled() {
            continue;
        }
        let due = last.is_none_or(|l| l.elapsed() >= Duration::from_secs(60));
        if !replica.take_deaths() && !due {
            continue;
        }
        last = Some(std::time::Instant::now());
        let before = store_now().saturating_sub(window.as_secs());
        let orphans = match replica.orphans(before).await {
            Ok(o) => o,
            Err(e) => {
                warn!(error = %e, "cannot look for streams of dead coordinators");
                continue;
            }
        };
        for found in orphans {
            match replica.claim(found).await {
                Ok(Some(claimed)) => sessions.do_send(sessions::Adopt(claimed)),
                Ok(None) => {}
                Err(e) => warn!(error = %e, "cannot take over a stream"),
            }
        }
    }
}

fn store_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}
