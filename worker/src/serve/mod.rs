//! `baton-worker serve`: a worker that joins a cluster over NATS.
//!
//! # Layout
//! - [`actor`]: the `Worker` actor (NATS endpoint, heartbeats, admission, drain).
//! - [`scheduler`]: the engine thread and its continuous batching.
//! - [`real`]: the burn engine behind the scheduler's [`scheduler::SeqEngine`] trait.
//! - [`sim`]: a simulated engine for routing and failover tests.

pub mod actor;
pub mod metrics;
pub mod models;
pub mod real;
pub mod scheduler;
pub mod sim;

use std::{
    collections::HashMap,
    path::PathBuf,
    sync::{mpsc, Arc},
    time::Duration,
};

use actix::prelude::*;
use anyhow::Context as _;
use baton_common::{
    config::ClusterConfig,
    env,
    ids::{CoordinatorId, WorkerId},
    protocol::{decode, Body, DrainReply, ModelInfo, Sequencer, TokenBatch},
    subjects::Subjects,
};
use clap::Args;
use futures::StreamExt;

use crate::{
    backend::BackendKind,
    compute::{self, ComputePriority},
    engine::{llama::WeightDtype, Engine},
};
use actor::{
    CancelMsg, Drain, LoadModelMsg, ProbeMsg, SubmitMsg, TokenizeMsg, UnloadModelMsg, Worker,
};
use scheduler::{Limits, Load, LoadSpec, Loader, Outbox, SeqEngine};

/// Arguments of `serve`; each overrides `cluster.toml`.
#[derive(Debug, Args)]
pub struct ServeArgs {
    /// Cluster configuration file.
    #[arg(long, env = env::CONFIG, default_value = "cluster.toml")]
    pub config: PathBuf,
    /// NATS server URL.
    #[arg(long, env = env::NATS_URL)]
    pub nats_url: Option<String>,
    /// Subject prefix.
    #[arg(long, env = env::SUBJECT_PREFIX)]
    pub subject_prefix: Option<String>,
    /// NATS credentials and TLS (override `nats.user`, `nats.tls_ca`, …).
    #[command(flatten)]
    pub nats: baton_common::nats::NatsArgs,
    /// GGUF model file.
    #[arg(long, env = env::MODEL)]
    pub model: Option<String>,
    /// Public model name.
    #[arg(long, env = env::MODEL_NAME)]
    pub model_name: Option<String>,
    /// Backend: cpu or cuda.
    #[arg(long, env = env::BACKEND)]
    pub backend: Option<BackendKind>,
    /// Weight format: native, native-i16, native-i8, f16 or f32.
    #[arg(long, env = env::WEIGHTS)]
    pub weights: Option<WeightDtype>,
    /// How the host KV store keeps keys and values: f16 or f32 (overrides
    /// `worker.kv_dtype`).
    #[arg(long)]
    pub kv_dtype: Option<crate::engine::llama::KvDtype>,
    /// Most sequences running at once.
    #[arg(long)]
    pub max_running: Option<u32>,
    /// Prefix cache budget in MiB (0: disabled).
    #[arg(long)]
    pub prefix_cache_mib: Option<u64>,
    /// Most tokens a step runs; longer prompts run in chunks (0: no limit; overrides
    /// `worker.max_step_tokens`).
    #[arg(long)]
    pub max_step_tokens: Option<u32>,
    /// How long a draining worker lets its streams run before it hands them over to
    /// other workers, in milliseconds (overrides `worker.drain_handover_ms`).
    #[arg(long)]
    pub drain_handover_ms: Option<u64>,
    /// Threads running the model (0: `RAYON_NUM_THREADS`, else one per core; overrides
    /// `worker.compute_threads`).
    #[arg(long)]
    pub compute_threads: Option<u32>,
    /// Scheduling class of those threads: idle or normal (overrides
    /// `worker.compute_priority`).
    #[arg(long)]
    pub compute_priority: Option<ComputePriority>,
    /// Reload the model file when it changes (overrides `worker.watch_model`).
    #[arg(long)]
    pub watch_model: bool,
    /// Run the simulated engine (no model; a test tool).
    #[arg(long)]
    pub simulated: bool,
    /// Milliseconds per step of the simulated engine.
    #[arg(long, default_value_t = 20)]
    pub sim_step_ms: u64,
}

/// How long a worker that has handed its streams over waits for its last messages to
/// go out before it leaves anyway.
const DRAIN_GRACE: Duration = Duration::from_secs(10);

/// Starts the engine thread with the model `first` names (built by `loader`, as later
/// loads are); returns the model it serves once it is loaded.
fn spawn_engine<E>(
    loader: Loader<E>,
    first: LoadSpec,
    limits: Limits,
    commands: mpsc::Receiver<scheduler::Command>,
    out: tokio::sync::mpsc::UnboundedSender<Outbox>,
    load: Arc<Load>,
) -> anyhow::Result<ModelInfo>
where
    E: SeqEngine + Send + 'static,
{
    let (ready_tx, ready_rx) = mpsc::channel();
    std::thread::Builder::new()
        .name("engine".into())
        .spawn(move || match loader(&first) {
            Ok(engine) => {
                // Served from the first heartbeat on.
                *load
                    .models
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner) = vec![engine.model_info()];
                let _ = ready_tx.send(Ok(engine.model_info()));
                scheduler::run(engine, loader, limits, commands, out, load);
            }
            Err(e) => {
                let _ = ready_tx.send(Err(e));
            }
        })
        .context("spawning the engine thread")?;
    ready_rx
        .recv()
        .context("the engine thread ended before loading")?
}

/// Runs a worker until SIGTERM or Ctrl-C, then drains and leaves.
pub fn run(args: ServeArgs) -> anyhow::Result<()> {
    let file = ClusterConfig::load(
        &args.config,
        args.config.as_path() != std::path::Path::new("cluster.toml"),
    )?;
    let mut cfg = file.worker.clone();
    if let Some(m) = &args.model {
        cfg.model = m.clone();
    }
    if let Some(n) = &args.model_name {
        cfg.model_name = Some(n.clone());
    }
    if let Some(r) = args.max_running {
        cfg.max_running = r;
    }
    if let Some(m) = args.prefix_cache_mib {
        cfg.prefix_cache_mib = m;
    }
    if let Some(n) = args.max_step_tokens {
        cfg.max_step_tokens = n;
    }
    let step_tokens = cfg.max_step_tokens as usize;
    if let Some(ms) = args.drain_handover_ms {
        cfg.drain_handover_ms = ms;
    }
    cfg.watch_model |= args.watch_model;
    let handover_after = Duration::from_millis(cfg.drain_handover_ms);
    let prefix_bytes =
        usize::try_from(cfg.prefix_cache_mib.saturating_mul(1 << 20)).unwrap_or(usize::MAX);
    let mut nats = file.nats.clone();
    if let Some(url) = &args.nats_url {
        nats.url = url.clone();
    }
    if let Some(prefix) = &args.subject_prefix {
        nats.subject_prefix = prefix.clone();
    }
    args.nats.apply(&mut nats);
    // Contradictory credentials or a missing certificate fail now, not after the model
    // has loaded.
    baton_common::nats::connect_options(&nats, "baton-worker")?;
    let subjects = Subjects::new(nats.subject_prefix.clone());
    let backend = match args.backend {
        Some(b) => b,
        None => cfg.backend.parse().map_err(anyhow::Error::msg)?,
    };
    let weights = match args.weights {
        Some(w) => w,
        None => cfg.weights.parse().map_err(anyhow::Error::msg)?,
    };
    let kv_dtype = match args.kv_dtype {
        Some(k) => k,
        None => cfg.kv_dtype.parse().map_err(anyhow::Error::msg)?,
    };
    let priority = match args.compute_priority {
        Some(p) => p,
        None => cfg.compute_priority.parse().map_err(anyhow::Error::msg)?,
    };
    compute::init(
        args.compute_threads.unwrap_or(cfg.compute_threads) as usize,
        priority,
    );
    let limits = Limits {
        max_running: cfg.max_running.max(1) as usize,
        max_queued: cfg.max_queued as usize,
        kv_budget: cfg.kv_budget_mib.saturating_mul(1 << 20),
    };
    let name = cfg.model_name();
    let load = Arc::new(Load::default());
    let (cmd_tx, cmd_rx) = mpsc::channel();
    let (out_tx, mut out_rx) = tokio::sync::mpsc::unbounded_channel::<Outbox>();
    let first = LoadSpec {
        path: PathBuf::from(&cfg.model),
        name,
    };
    let weights = crate::backend::serving_weights(backend, weights);
    let info = if args.simulated {
        let pace = Duration::from_millis(args.sim_step_ms);
        let loader: Loader<sim::SimEngine> =
            Arc::new(move |spec: &LoadSpec| Ok(sim::SimEngine::new(spec.name.clone(), pace)));
        spawn_engine(loader, first, limits, cmd_rx, out_tx, load.clone())?
    } else {
        crate::with_backend!(backend, B => {
            let loader: Loader<real::RealEngine<B>> = Arc::new(move |spec: &LoadSpec| {
                let mut engine = Engine::<B>::load(&spec.path, weights, &Default::default())?;
                engine.set_kv_dtype(kv_dtype);
                engine.set_prefix_cache(prefix_bytes);
                engine.set_step_tokens(step_tokens);
                tracing::info!(
                    %backend,
                    engine = if engine.model().host_path() { "host" } else { "device" },
                    %weights,
                    held = %engine.model().held_formats(),
                    kv = %kv_dtype,
                    model = %spec.name,
                    "engine loaded"
                );
                Ok(real::RealEngine::new(engine, spec.name.clone()))
            });
            spawn_engine(loader, first, limits, cmd_rx, out_tx, load.clone())?
        })
    };
    tracing::info!(model = %info.name, context_length = info.context_length, "serving");

    let system = actix_rt::System::new();
    system.block_on(async move {
        let id = WorkerId::random();
        let client = baton_common::nats::connect(&nats, &format!("baton-worker-{id}")).await?;
        let sequencer = Arc::new(Sequencer::new(id.0));
        let submits = client.subscribe(subjects.submit(id)).await?;
        let cancels = client.subscribe(subjects.cancel(id)).await?;
        let metrics = metrics::WorkerMetrics::new(load.clone(), limits.kv_budget);
        match metrics::serve(&cfg.metrics_listen, metrics.clone()) {
            Ok(Some(addr)) => tracing::info!(%addr, "metrics listening"),
            Ok(None) => {}
            Err(e) => {
                tracing::warn!(error = %e, listen = %cfg.metrics_listen, "cannot serve metrics")
            }
        }
        let drain_load = load.clone();
        let worker = Worker {
            metrics: metrics.clone(),
            id,
            client: client.clone(),
            subjects: subjects.clone(),
            sequencer: sequencer.clone(),
            commands: cmd_tx,
            load,
            limits,
            weights,
            simulated: args.simulated,
            watch: cfg.watch_model.then(|| {
                actor::ModelWatch::new(
                    PathBuf::from(&cfg.model),
                    info.name.clone(),
                    Duration::from_millis(cfg.watch_interval_ms.max(100)),
                )
            }),
            heartbeat_interval: Duration::from_millis(cfg.heartbeat_interval_ms.max(50)),
            draining: false,
        }
        .start();

        let addr = worker.clone();
        let (drain_client, drain_sequencer) = (client.clone(), sequencer.clone());
        listen(submits, "submit", metrics.clone(), move |body, reply| match body {
            Body::Submit(submit) => {
                addr.do_send(SubmitMsg { submit, reply });
                true
            }
            Body::Probe(probe) => {
                if let Some(reply) = reply {
                    addr.do_send(ProbeMsg {
                        streams: probe.streams,
                        reply,
                    });
                }
                true
            }
            Body::Tokenize(request) => {
                if let Some(reply) = reply {
                    addr.do_send(TokenizeMsg { request, reply });
                }
                true
            }
            // An operator's drain, forwarded by a coordinator: the same drain as SIGTERM's.
            Body::Drain(order) => {
                tracing::info!(worker = %id, reason = %order.reason, "drain requested over NATS");
                addr.do_send(Drain {
                    handover_after: order
                        .handover_after_ms
                        .map_or(handover_after, Duration::from_millis),
                });
                if let Some(reply) = reply {
                    let payload = drain_sequencer.encode(Body::DrainReply(DrainReply {
                        worker: id,
                        running: drain_load
                            .running
                            .load(std::sync::atomic::Ordering::Relaxed)
                            as u32,
                        queued: drain_load.queued.load(std::sync::atomic::Ordering::Relaxed) as u32,
                    }));
                    let client = drain_client.clone();
                    actix::spawn(async move {
                        if let Err(e) = client.publish(reply, payload.into()).await {
                            tracing::warn!(error = %e, "drain reply not published");
                        }
                    });
                }
                true
            }
            // An operator's model load or unload, forwarded by a coordinator.
            Body::LoadModel(order) => {
                addr.do_send(LoadModelMsg { order, reply });
                true
            }
            Body::UnloadModel(order) => {
                addr.do_send(UnloadModelMsg { order, reply });
                true
            }
            _ => false,
        });
        let addr = worker.clone();
        listen(cancels, "cancel", metrics.clone(), move |body, _| match body {
            Body::Cancel(c) => {
                addr.do_send(CancelMsg {
                    streams: c.streams.iter().map(|s| (s.stream, s.attempt)).collect(),
                });
                true
            }
            _ => false,
        });
        // Token batches: one NATS message per coordinator per step. Ends when the engine
        // thread does (after a drain), once everything it produced is published.
        let publisher = {
            let client = client.clone();
            let subjects = subjects.clone();
            actix::spawn(async move {
                // One envelope sequence per subject: a coordinator sees a gap in its own
                // subject's numbers only when one of its messages was lost.
                let mut sequencers: HashMap<CoordinatorId, Sequencer> = HashMap::new();
                while let Some(outbox) = out_rx.recv().await {
                    for (coordinator, events) in outbox {
                        let payload = sequencers
                            .entry(coordinator)
                            .or_insert_with(|| Sequencer::new(id.0))
                            .encode(Body::Tokens(TokenBatch { worker: id, events }));
                        if let Err(e) = client
                            .publish(subjects.tokens(coordinator), payload.into())
                            .await
                        {
                            tracing::warn!(error = %e, "token batch not published");
                        }
                    }
                }
            })
        };

        // The publisher ends by itself only after a drain requested over NATS (the
        // engine thread then stops once its work is done).
        let mut publisher = publisher;
        let drained = tokio::select! {
            _ = shutdown_signal() => false,
            _ = &mut publisher => true,
        };
        if !drained {
            worker.do_send(Drain { handover_after });
            // Finish (or hand over) what was accepted; bounded, so a worker whose NATS is
            // gone still leaves.
            if tokio::time::timeout(handover_after + DRAIN_GRACE, publisher)
                .await
                .is_err()
            {
                tracing::warn!(worker = %id, "drain did not finish in time; leaving anyway");
            }
        }
        let _ = tokio::time::timeout(Duration::from_secs(2), client.flush()).await;
        tracing::info!(worker = %id, "drained; leaving");
        actix_rt::System::current().stop();
        anyhow::Ok(())
    })
}

/// Decodes every message of `sub` and hands it to `handle`, which says whether the kind
/// belongs on this subject. Malformed or misplaced messages are logged, counted and
/// dropped.
fn listen(
    mut sub: async_nats::Subscriber,
    what: &'static str,
    metrics: Arc<metrics::WorkerMetrics>,
    mut handle: impl FnMut(Body, Option<async_nats::Subject>) -> bool + 'static,
) {
    actix::spawn(async move {
        while let Some(msg) = sub.next().await {
            if let Some(id) = msg
                .headers
                .as_ref()
                .and_then(|h| h.get(baton_common::subjects::REQUEST_ID_HEADER))
            {
                tracing::info!(request_id = %id, "{what} received");
            }
            match decode(&msg.payload) {
                Ok(wire) => {
                    if !handle(wire.body, msg.reply) {
                        metrics.dropped(what, "misplaced");
                        if let Some(held) = GARBAGE_WARNINGS.admit() {
                            tracing::warn!(
                                held_back = held,
                                "unexpected message kind on the {what} subject dropped"
                            );
                        }
                    }
                }
                Err(e) => {
                    metrics.dropped(what, "malformed");
                    if let Some(held) = GARBAGE_WARNINGS.admit() {
                        tracing::warn!(error = %e, held_back = held, "malformed message on the {what} subject dropped");
                    }
                }
            }
        }
    });
}

/// Garbage on this worker's subjects is logged once a second (with the count held back;
/// the metrics count each message).
static GARBAGE_WARNINGS: baton_common::throttle::Throttle =
    baton_common::throttle::Throttle::new(std::time::Duration::from_secs(1));

/// Resolves on SIGTERM or Ctrl-C.
async fn shutdown_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        match signal(SignalKind::terminate()) {
            Ok(mut term) => {
                tokio::select! {
                    _ = term.recv() => {}
                    _ = tokio::signal::ctrl_c() => {}
                }
            }
            Err(_) => {
                let _ = tokio::signal::ctrl_c().await;
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
}
