//! The `Worker` actor: the worker's NATS endpoint, heartbeats, admission and drain.

use std::{
    sync::{atomic::Ordering, mpsc, Arc},
    time::Duration,
};

use actix::prelude::*;
use baton_common::{
    ids::{StreamId, WorkerId},
    protocol::{
        Body, Heartbeat, ModelInfo, ProbeReply, Sequencer, StreamAttempt, Submit, SubmitOutcome,
        SubmitReply, TokenizeRequest,
    },
    subjects::Subjects,
};

use super::scheduler::{Command, Limits, Load};

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
    pub(crate) model: ModelInfo,
    pub(crate) limits: Limits,
    pub(crate) heartbeat_interval: Duration,
    /// Taking no new work; set on drain.
    pub(crate) draining: bool,
    /// Submit outcomes, cancels and probes are counted here.
    pub(crate) metrics: Arc<super::metrics::WorkerMetrics>,
}

impl Worker {
    fn heartbeat(&self) -> Heartbeat {
        Heartbeat {
            worker: self.id,
            models: vec![self.model.clone()],
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
        tracing::info!(worker = %self.id, model = %self.model.name, "worker ready");
        self.publish_heartbeat();
        ctx.run_interval(self.heartbeat_interval, |this, _| this.publish_heartbeat());
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
