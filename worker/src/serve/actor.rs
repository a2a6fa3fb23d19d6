//! The `Worker` actor: the worker's NATS endpoint, heartbeats, admission and drain.

use std::{
    sync::{atomic::Ordering, mpsc, Arc},
    time::Duration,
};

use actix::prelude::*;
use baton_common::{
    ids::{StreamId, WorkerId},
    protocol::{
        Body, ErrorKind, Heartbeat, LoadModel, ModelReply, ProbeReply, Sequencer, StreamAttempt,
        Submit, SubmitOutcome, SubmitReply, TokenizeRequest, UnloadModel, WireError,
    },
    subjects::Subjects,
};

use super::scheduler::{Command, Limits, Load, LoadSpec, ModelResult};
use crate::engine::llama::WeightDtype;

/// A worker process, as the cluster sees it.
pub struct Worker {
    /// This worker's id, in every heartbeat and token batch.
    pub(crate) id: WorkerId,
    pub(crate) client: async_nats::Client,
    pub(crate) subjects: Subjects,
    /// Numbers every message this worker publishes.
    pub(crate) sequencer: Arc<Sequencer>,
    /// To the engine thread.
    pub(crate) commands: mpsc::Sender<Command>,
    /// Load figures kept by the engine thread.
    pub(crate) load: Arc<Load>,
    pub(crate) limits: Limits,
    /// The weight format models load in (for the memory a new one needs).
    pub(crate) weights: WeightDtype,
    /// A simulated engine: model files are checked, not measured against memory.
    pub(crate) simulated: bool,
    pub(crate) heartbeat_interval: Duration,
    /// Taking no new work; set on drain.
    pub(crate) draining: bool,
    /// Submit outcomes, cancels and probes are counted here.
    pub(crate) metrics: Arc<super::metrics::WorkerMetrics>,
    /// The model file watched for a new version, when `worker.watch_model` is on.
    pub(crate) watch: Option<ModelWatch>,
}

/// Size and modification times of a watched model file and of the `.sha256` beside it.
type Stamp = (
    u64,
    Option<std::time::SystemTime>,
    Option<std::time::SystemTime>,
);

/// A model file watched for a new version: a change that holds still for one poll is
/// loaded in place of the model served under `name`.
pub struct ModelWatch {
    path: std::path::PathBuf,
    name: String,
    every: Duration,
    /// The version last loaded (or tried).
    seen: Option<Stamp>,
    /// A new version seen once, loaded if it is the same at the next poll.
    settling: Option<Stamp>,
}

impl ModelWatch {
    /// Watches `path`, served as `name`, every `every`.
    pub fn new(path: std::path::PathBuf, name: String, every: Duration) -> Self {
        let seen = Self::stamp(&path);
        Self {
            path,
            name,
            every,
            seen,
            settling: None,
        }
    }

    fn stamp(path: &std::path::Path) -> Option<Stamp> {
        let meta = std::fs::metadata(path).ok()?;
        let sha = std::fs::metadata(format!("{}.sha256", path.display()))
            .ok()
            .and_then(|m| m.modified().ok());
        Some((meta.len(), meta.modified().ok(), sha))
    }

    /// Whether the file has a new version to load now.
    fn poll(&mut self) -> bool {
        let now = Self::stamp(&self.path);
        if now.is_none() || now == self.seen {
            self.settling = None;
            return false;
        }
        if self.settling == now {
            self.seen = now;
            self.settling = None;
            return true;
        }
        self.settling = now;
        false
    }
}

impl Worker {
    fn heartbeat(&self) -> Heartbeat {
        Heartbeat {
            worker: self.id,
            models: self.load.models(),
            capacity: self.limits.max_running as u32,
            running: self.load.running.load(Ordering::Relaxed) as u32,
            queued: self.load.queued.load(Ordering::Relaxed) as u32,
            kv_used_bytes: self.load.kv_bytes.load(Ordering::Relaxed),
            kv_budget_bytes: self.limits.kv_budget,
            draining: self.draining,
            version: env!("CARGO_PKG_VERSION").to_owned(),
        }
    }

    fn publish_heartbeat(&self) {
        let payload = self.sequencer.encode(Body::Heartbeat(self.heartbeat()));
        let client = self.client.clone();
        let subject = self.subjects.heartbeat();
        actix::spawn(async move {
            if let Err(e) = client.publish(subject, payload.into()).await {
                tracing::warn!(error = %e, "heartbeat not published");
            }
        });
    }
}

impl Actor for Worker {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Self::Context) {
        let models: Vec<String> = self.load.models().into_iter().map(|m| m.name).collect();
        tracing::info!(worker = %self.id, models = %models.join(", "), "worker ready");
        self.publish_heartbeat();
        ctx.run_interval(self.heartbeat_interval, |this, _| this.publish_heartbeat());
        if let Some(watch) = &self.watch {
            tracing::info!(path = %watch.path.display(), "watching the model file");
            ctx.run_interval(watch.every, |this, ctx| {
                let Some(watch) = this.watch.as_mut() else {
                    return;
                };
                if this.draining || !watch.poll() {
                    return;
                }
                tracing::info!(path = %watch.path.display(), "the model file changed; loading it beside");
                let order = LoadModel {
                    path: watch.path.display().to_string(),
                    sha256: None,
                    name: Some(watch.name.clone()),
                    add: false,
                };
                ctx.address().do_send(LoadModelMsg { order, reply: None });
            });
        }
    }
}

/// New sequences from a coordinator.
#[derive(Message)]
#[rtype(result = "()")]
pub struct SubmitMsg {
    /// The decoded submit.
    pub submit: Submit,
    /// Where the coordinator waits for the answer.
    pub reply: Option<async_nats::Subject>,
}

impl Handler<SubmitMsg> for Worker {
    type Result = ();

    fn handle(&mut self, msg: SubmitMsg, _: &mut Self::Context) {
        let (tx, rx) = tokio::sync::oneshot::channel();
        let sent = self.commands.send(Command::Submit {
            coordinator: msg.submit.coordinator,
            sequences: msg.submit.sequences,
            reply: tx,
        });
        if sent.is_err() {
            tracing::error!("engine thread is gone; submit dropped");
            return;
        }
        let reply = msg.reply;
        let client = self.client.clone();
        let sequencer = self.sequencer.clone();
        let metrics = self.metrics.clone();
        actix::spawn(async move {
            if let Ok(outcomes) = rx.await {
                for o in &outcomes {
                    match o {
                        SubmitOutcome::Accepted(a) => {
                            tracing::info!(stream = %a.stream, prompt_tokens = a.prompt_tokens, "sequence accepted");
                            metrics.submitted("accepted");
                        }
                        SubmitOutcome::Refused(r) => {
                            tracing::info!(stream = %r.stream, kind = r.error.kind.as_str(), "sequence refused");
                            metrics.submitted(r.error.kind.as_str());
                        }
                    }
                }
                let Some(reply) = reply else { return };
                let payload = sequencer.encode(Body::SubmitReply(SubmitReply { outcomes }));
                if let Err(e) = client.publish(reply, payload.into()).await {
                    tracing::warn!(error = %e, "submit reply not published");
                }
            }
        });
    }
}

/// A client's tokenize or detokenize request, forwarded by a coordinator.
#[derive(Message)]
#[rtype(result = "()")]
pub struct TokenizeMsg {
    /// What to tokenize.
    pub request: TokenizeRequest,
    /// Where the coordinator waits for the answer.
    pub reply: async_nats::Subject,
}

impl Handler<TokenizeMsg> for Worker {
    type Result = ();

    fn handle(&mut self, msg: TokenizeMsg, _: &mut Self::Context) {
        let (tx, rx) = tokio::sync::oneshot::channel();
        let sent = self.commands.send(Command::Tokenize {
            request: msg.request,
            reply: tx,
        });
        if sent.is_err() {
            tracing::error!("engine thread is gone; tokenize request dropped");
            return;
        }
        let client = self.client.clone();
        let sequencer = self.sequencer.clone();
        actix::spawn(async move {
            if let Ok(answer) = rx.await {
                let payload = sequencer.encode(Body::TokenizeReply(answer));
                if let Err(e) = client.publish(msg.reply, payload.into()).await {
                    tracing::warn!(error = %e, "tokenize reply not published");
                }
            }
        });
    }
}

/// A coordinator asks whether this worker is alive.
#[derive(Message)]
#[rtype(result = "()")]
pub struct ProbeMsg {
    /// The streams the coordinator expects here.
    pub streams: Vec<StreamAttempt>,
    /// Where the coordinator waits for the answer.
    pub reply: async_nats::Subject,
}

impl Handler<ProbeMsg> for Worker {
    type Result = ();

    fn handle(&mut self, msg: ProbeMsg, _: &mut Self::Context) {
        self.metrics.probes.inc();
        let payload = self.sequencer.encode(Body::ProbeReply(ProbeReply {
            worker: self.id,
            running: self.load.running.load(Ordering::Relaxed) as u32,
            queued: self.load.queued.load(Ordering::Relaxed) as u32,
            missing: msg
                .streams
                .into_iter()
                .filter(|s| !self.load.holds(s.stream, s.attempt))
                .collect(),
        }));
        let client = self.client.clone();
        actix::spawn(async move {
            if let Err(e) = client.publish(msg.reply, payload.into()).await {
                tracing::warn!(error = %e, "probe reply not published");
            }
        });
    }
}

/// Sequences to stop.
#[derive(Message)]
#[rtype(result = "()")]
pub struct CancelMsg {
    /// The streams and the latest attempt of each to stop.
    pub streams: Vec<(StreamId, u32)>,
}

impl Handler<CancelMsg> for Worker {
    type Result = ();

    fn handle(&mut self, msg: CancelMsg, _: &mut Self::Context) {
        self.metrics.cancels.inc();
        let _ = self.commands.send(Command::Cancel(msg.streams));
    }
}

/// Stop taking work; let what was accepted run for `handover_after`, then hand what
/// still runs over to other workers.
#[derive(Message)]
#[rtype(result = "()")]
pub struct Drain {
    /// How long accepted streams may run on here.
    pub handover_after: Duration,
}

impl Handler<Drain> for Worker {
    type Result = ();

    fn handle(&mut self, msg: Drain, ctx: &mut Self::Context) {
        if !self.draining {
            tracing::info!(
                worker = %self.id,
                handover_after_ms = msg.handover_after.as_millis() as u64,
                "draining: no new work, finishing what runs"
            );
            self.draining = true;
            let _ = self.commands.send(Command::Drain);
            self.publish_heartbeat();
        }
        // A later order with a shorter delay hands over sooner; handing over twice is
        // harmless.
        ctx.run_later(msg.handover_after, |this, _| {
            let _ = this.commands.send(Command::HandOver);
        });
    }
}

/// Whether everything accepted has finished.
#[derive(Message)]
#[rtype(result = "bool")]
pub struct IsIdle;

impl Handler<IsIdle> for Worker {
    type Result = bool;

    fn handle(&mut self, _: IsIdle, _: &mut Self::Context) -> bool {
        self.load.running.load(Ordering::Relaxed) == 0
            && self.load.queued.load(Ordering::Relaxed) == 0
    }
}

/// An operator's order to load a model, forwarded by a coordinator.
#[derive(Message)]
#[rtype(result = "()")]
pub struct LoadModelMsg {
    /// The order.
    pub order: LoadModel,
    /// Where the coordinator waits for the answer.
    pub reply: Option<async_nats::Subject>,
}

/// An operator's order to stop serving a model.
#[derive(Message)]
#[rtype(result = "()")]
pub struct UnloadModelMsg {
    /// The order.
    pub order: UnloadModel,
    /// Where the coordinator waits for the answer.
    pub reply: Option<async_nats::Subject>,
}

/// Publish a heartbeat now (the models served changed).
#[derive(Message)]
#[rtype(result = "()")]
struct Beat;

impl Handler<Beat> for Worker {
    type Result = ();

    fn handle(&mut self, _: Beat, _: &mut Self::Context) {
        self.publish_heartbeat();
    }
}

impl Worker {
    /// The name a loaded model is served as: the one asked for; else the name of the
    /// model it replaces (the only one served), or the file's stem when it is added.
    fn load_name(&self, order: &LoadModel) -> Result<String, WireError> {
        if let Some(name) = order.name.as_ref().filter(|n| !n.trim().is_empty()) {
            return Ok(name.clone());
        }
        let served = self.load.models();
        if !order.add {
            if let [only] = served.as_slice() {
                return Ok(only.name.clone());
            }
        }
        if order.add || served.is_empty() {
            if let Some(stem) = std::path::Path::new(&order.path).file_stem() {
                return Ok(stem.to_string_lossy().into_owned());
            }
        }
        Err(WireError {
            kind: ErrorKind::InvalidRequest,
            message: "name the model to serve: this worker serves several".into(),
        })
    }

    /// Answers a model order once the engine thread has (`rx`), and announces the models
    /// served.
    fn answer_model_order(
        &self,
        op: &'static str,
        rx: tokio::sync::oneshot::Receiver<ModelResult>,
        reply: Option<async_nats::Subject>,
        me: Addr<Worker>,
    ) {
        let (id, client, sequencer, metrics, load) = (
            self.id,
            self.client.clone(),
            self.sequencer.clone(),
            self.metrics.clone(),
            self.load.clone(),
        );
        actix::spawn(async move {
            let result = rx.await.unwrap_or_else(|_| {
                Err(WireError {
                    kind: ErrorKind::Internal,
                    message: "the engine thread is gone".into(),
                })
            });
            send_model_reply(op, result, reply, id, &client, &sequencer, &metrics, &load).await;
            me.do_send(Beat);
        });
    }
}

/// Publishes the answer to a model order on `reply`, and counts and logs it.
#[allow(clippy::too_many_arguments)]
async fn send_model_reply(
    op: &'static str,
    result: ModelResult,
    reply: Option<async_nats::Subject>,
    worker: baton_common::ids::WorkerId,
    client: &async_nats::Client,
    sequencer: &Sequencer,
    metrics: &super::metrics::WorkerMetrics,
    load: &Load,
) {
    let body = match result {
        Ok(change) => {
            metrics.model_op(op, "ok");
            ModelReply {
                worker,
                error: None,
                loaded: change.loaded,
                serving: change.serving,
                retiring_streams: change.retiring_streams,
            }
        }
        Err(error) => {
            tracing::warn!(op, error = %error.message, "model order refused; the models served stay");
            metrics.model_op(op, error.kind.as_str());
            ModelReply {
                worker,
                error: Some(error),
                loaded: None,
                serving: load.models(),
                retiring_streams: load.retiring_streams.load(Ordering::Relaxed) as u32,
            }
        }
    };
    let Some(reply) = reply else { return };
    let payload = sequencer.encode(Body::ModelReply(body));
    if let Err(e) = client.publish(reply, payload.into()).await {
        tracing::warn!(error = %e, "model reply not published");
    }
}

impl Handler<LoadModelMsg> for Worker {
    type Result = ();

    fn handle(&mut self, msg: LoadModelMsg, ctx: &mut Self::Context) {
        let order = msg.order;
        tracing::info!(path = %order.path, add = order.add, "model load requested");
        let (tx, rx) = tokio::sync::oneshot::channel();
        match self.load_name(&order) {
            Err(e) => {
                let _ = tx.send(Err(e));
            }
            Ok(name) => {
                let path = std::path::PathBuf::from(&order.path);
                let (weights, simulated) = (self.weights, self.simulated);
                let check_path = path.clone();
                let sha = order.sha256.clone();
                let sent = self.commands.send(Command::Load {
                    spec: LoadSpec { path, name },
                    check: Box::new(move || {
                        let available = if simulated {
                            None
                        } else {
                            super::models::mem_available()
                        };
                        super::models::check_model_file(
                            &check_path,
                            sha.as_deref(),
                            weights,
                            available,
                        )
                    }),
                    add: order.add,
                    reply: tx,
                });
                if sent.is_err() {
                    // The answer below says so.
                    tracing::error!("engine thread is gone; model load dropped");
                }
            }
        }
        self.answer_model_order("load", rx, msg.reply, ctx.address());
    }
}

impl Handler<UnloadModelMsg> for Worker {
    type Result = ();

    fn handle(&mut self, msg: UnloadModelMsg, ctx: &mut Self::Context) {
        tracing::info!(model = %msg.order.name, "model unload requested");
        let (tx, rx) = tokio::sync::oneshot::channel();
        if self
            .commands
            .send(Command::Unload {
                name: msg.order.name,
                reply: tx,
            })
            .is_err()
        {
            // The answer below says so.
            tracing::error!("engine thread is gone; model unload dropped");
        }
        self.answer_model_order("unload", rx, msg.reply, ctx.address());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_watched_file_is_loaded_once_it_holds_still() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("m.gguf");
        std::fs::write(&path, b"version one").expect("write");
        let mut watch = ModelWatch::new(path.clone(), "m".into(), Duration::from_secs(1));
        assert!(!watch.poll(), "nothing changed");
        std::fs::write(&path, b"version two, longer").expect("write");
        assert!(!watch.poll(), "a change waits one poll");
        assert!(watch.poll(), "then loads");
        assert!(!watch.poll(), "once");
        // A file still being written is loaded only when it stops changing.
        std::fs::write(&path, b"version three, being written").expect("write");
        assert!(!watch.poll());
        std::fs::write(&path, b"version three, being written, done").expect("write");
        assert!(!watch.poll());
        assert!(watch.poll());
        // A new .sha256 beside it is a new version too.
        std::fs::write(dir.path().join("m.gguf.sha256"), b"00").expect("write");
        assert!(!watch.poll());
        assert!(watch.poll());
        // A file gone is no version.
        std::fs::remove_file(&path).expect("remove");
        assert!(!watch.poll());
        assert!(!watch.poll());
    }
}
