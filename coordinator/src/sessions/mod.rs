//! Stream sessions: every stream's state, checkpoints, failover, batching and
//! subscribers.
//!
//! A session lives from the request until its stream ends. It holds the request, every
//! token so far (id, text) and the chain hash after the last one, the worker running the
//! current attempt, and the channels of the clients listening.
//!
//! - **Tokens** arrive in worker messages ([`DispatchTokens`]). Each event is checked
//!   against the session (right attempt, next position) and appended to the checkpoint
//!   store; in `sync` mode the store is flushed (write + sync) before the tokens go to
//!   the clients, and in `async` mode (the default) only a new stream's tokens may
//!   wait, for the flush that takes its record to disk. One flush runs at a time;
//!   everything that arrives meanwhile waits for the next one (group commit), and the
//!   actor keeps serving other messages. A client that attaches gets the tokens
//!   already forwarded, then the rest with everyone else.
//! - **Failover**: a stream moves to another worker — a *resume* with every token so
//!   far and the last chain hash — when its worker fails it, when the registry drops
//!   the worker (heartbeats stopped), when a probe finds nobody on the worker's subject,
//!   when its events skip a position (a lost message), or when it stalls past
//!   `stall_timeout_ms` although the worker answers. Each dispatch of a stream is an
//!   *attempt*; events of older attempts are dropped and their sequences cancelled.
//! - **Clients** subscribe with [`StartStream`] (new) or [`Attach`] (reconnect with
//!   `Last-Event-ID`: the tokens after the given position are replayed from memory or the
//!   store, then the live rest follows). A client may attach only to a stream its
//!   [`StreamAccess`](crate::auth::StreamAccess) allows (its own key's, or any for an
//!   admin key); any other stream is unknown to it, exactly as one that never existed. When the last client of a
//!   stream goes away, the worker is told to stop at once; a client that comes back
//!   within the reconnect window resumes the stream from its checkpoint. After the
//!   window the stream is dropped from memory and the store, so that streams nobody
//!   comes back to do not pile up.
//! - **Restart**: streams the store holds unfinished are dispatched again when the
//!   coordinator starts ([`Sessions::recover`]), and run to their end with or without a
//!   client, so that a client reconnecting to the new process gets its whole text.
//!
//! # Layout
//! - [`table`]: [`SessionTable`], the state as plain data: events in, effects out.
//! - [`session`]: one stream ([`Update`] is what its clients receive).
//! - [`batcher`]: new streams sharing a submit.
//! - [`failover`]: [`ResumeReason`], and which detached streams go.
//! - [`checkpoint`]: recovery after a restart, replays of ended streams, collection.
//! - [`link`]: [`WorkerLink`], what the sessions need of the workers ([`NatsLink`]).
//! - [`messages`]: what the fronts send the actor.
//!
//! [`Sessions`] is the actor: each message goes to the table, and the actor runs the
//! effects it returns (futures on its own context, timers).

pub mod batcher;
pub mod checkpoint;
pub mod failover;
pub mod link;
pub mod messages;
pub mod session;
pub mod table;

#[cfg(test)]
mod tests;

use std::rc::Rc;
use std::time::{Duration, Instant};

use actix::prelude::*;

pub use failover::ResumeReason;
pub use link::{NatsLink, WorkerLink};
pub use messages::{Adopt, Attach, AttachError, Attached, Detach, StartStream};
pub use session::Update;
pub use table::{Effect, SessionSettings, SessionTable};

use crate::actors::messages::{DispatchTokens, WorkerLost};
use crate::dispatch::DispatchError;

/// The sessions actor: the table, and the link that carries its effects to workers.
pub struct Sessions {
    table: SessionTable,
    link: Rc<dyn WorkerLink>,
}

impl Sessions {
    /// An actor over `table`, reaching workers through `link`.
    pub fn new(table: SessionTable, link: Rc<dyn WorkerLink>) -> Self {
        Self { table, link }
    }

    /// Loads the store's unfinished streams (dispatched again once the actor starts).
    pub fn recover(&mut self) -> usize {
        self.table.recover()
    }

    /// Runs `effects`: futures on this actor's context, whose outcomes go back to the
    /// table (and their effects run in turn).
    fn run(&mut self, effects: Vec<Effect>, ctx: &mut Context<Self>) {
        for effect in effects {
            match effect {
                Effect::Dispatch(d) => {
                    let d = *d;
                    let fut = self.link.dispatch(d.request, d.exclude, d.deadline);
                    let (stream, attempt, fallback, reply) =
                        (d.stream, d.attempt, d.fallback, d.reply);
                    ctx.spawn(fut.into_actor(self).map(move |result, this, ctx| {
                        let result = match (result, fallback) {
                            // No other worker: the refusal is the answer.
                            (Err(DispatchError::Route(_)), Some(fallback)) => Err(fallback),
                            (result, _) => result,
                        };
                        let effects =
                            this.table
                                .dispatched(stream, attempt, result, reply, Instant::now());
                        this.run(effects, ctx);
                    }));
                }
                Effect::SubmitBatch {
                    model,
                    requests,
                    replies,
                } => {
                    let fut = self.link.dispatch_batch(requests);
                    ctx.spawn(
                        fut.into_actor(self)
                            .map(move |(worker, results), this, ctx| {
                                let effects = this.table.batch_done(
                                    &model,
                                    worker,
                                    results,
                                    replies,
                                    Instant::now(),
                                );
                                this.run(effects, ctx);
                            }),
                    );
                }
                Effect::Cancel { worker, streams } => self.link.cancel(worker, streams),
                Effect::Release(worker) => self.link.release(worker),
                Effect::Forget(worker) => self.link.forget(worker),
                Effect::ForgetSequences(worker) => self.link.forget_sequences(worker),
                Effect::Probe {
                    worker,
                    streams,
                    timeout,
                } => {
                    let fut = self.link.probe(worker, streams, timeout);
                    ctx.spawn(fut.into_actor(self).map(move |probe, this, ctx| {
                        let effects = this.table.probed(worker, probe, Instant::now());
                        this.run(effects, ctx);
                    }));
                }
                Effect::Flush(store) => {
                    let fut = async move { store.flush().await.map_err(|e| e.to_string()) };
                    ctx.spawn(fut.into_actor(self).map(|flushed, this, ctx| {
                        let effects = this.table.flushed(flushed, Instant::now());
                        this.run(effects, ctx);
                    }));
                }
                Effect::Wake { after, model } => {
                    ctx.run_later(after, move |this, ctx| {
                        let effects = this.table.wake(&model, Instant::now());
                        this.run(effects, ctx);
                    });
                }
            }
        }
    }
}

impl Actor for Sessions {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Context<Self>) {
        let tick = (self.table.settings.stall_probe / 4)
            .clamp(Duration::from_millis(20), Duration::from_millis(250));
        ctx.run_interval(tick, |this, ctx| {
            let effects = this.table.tick(Instant::now());
            this.run(effects, ctx);
        });
        self.table.collect();
        ctx.run_interval(Duration::from_secs(30), |this, _| this.table.collect());
        // The cancels of recovered streams' old attempts, then their new dispatches.
        let mut effects = self.table.effects();
        effects.extend(self.table.restart(Instant::now()));
        self.run(effects, ctx);
    }
}

impl Handler<StartStream> for Sessions {
    type Result = MessageResult<StartStream>;

    fn handle(&mut self, msg: StartStream, ctx: &mut Context<Self>) -> Self::Result {
        let (rx, effects) = self.table.start(msg, Instant::now());
        self.run(effects, ctx);
        MessageResult(rx)
    }
}

impl Handler<Attach> for Sessions {
    type Result = ResponseActFuture<Self, Result<Attached, AttachError>>;

    fn handle(&mut self, msg: Attach, ctx: &mut Context<Self>) -> Self::Result {
        let again = msg.clone();
        let (attached, effects) = self.table.attach(msg, Instant::now());
        self.run(effects, ctx);
        let replica = match (&attached, self.table.replica()) {
            (Err(AttachError::Unknown(_)), Some(replica)) => replica.clone(),
            _ => return Box::pin(actix::fut::ready(attached)),
        };
        // Not here: JetStream may hold it (another coordinator's, or a dead one's).
        Box::pin(remote_attach(replica, again.clone()).into_actor(self).map(
            move |outcome, this, ctx| match outcome {
                Remote::Done(result) => result,
                Remote::Claimed(claimed) => {
                    let effects = this.table.adopt(claimed, Instant::now());
                    this.run(effects, ctx);
                    let (attached, effects) = this.table.attach(again, Instant::now());
                    this.run(effects, ctx);
                    attached
                }
            },
        ))
    }
}

/// What JetStream made of an attach to a stream this coordinator does not hold.
enum Remote {
    /// Followed from JetStream, or not found.
    Done(Result<Attached, AttachError>),
    /// Its coordinator is dead and this one took it over: attach to it here.
    Claimed(crate::replica::Claimed),
}

/// [`remote_attach_once`], tried again while JetStream does not answer (a server of its
/// cluster died and its streams elect new leaders), for up to `RETRY_FOR`.
async fn remote_attach(replica: crate::replica::Replica, msg: Attach) -> Remote {
    let mut backoff = crate::replica::Backoff::new(std::time::Duration::from_millis(100));
    loop {
        match remote_attach_once(&replica, msg.clone()).await {
            Remote::Done(Err(AttachError::Unavailable(e))) => {
                tracing::debug!(stream = %msg.stream, error = %e, "JetStream did not answer an attach; trying again");
                if !backoff.wait().await {
                    return Remote::Done(Err(AttachError::Unavailable(e)));
                }
            }
            outcome => return outcome,
        }
    }
}

async fn remote_attach_once(replica: &crate::replica::Replica, msg: Attach) -> Remote {
    use crate::replica::attach_error;
    let stream = msg.stream;
    let found = match replica.lookup(stream).await {
        Ok(Some(found)) if msg.access.allows(found.record.owner.as_ref()) => found,
        Ok(_) => return Remote::Done(Err(AttachError::Unknown(stream))),
        Err(e) => return Remote::Done(Err(attach_error(e))),
    };
    if found.record.end.is_none() && !replica.alive(found.owner) {
        match replica.claim(found.clone()).await {
            Ok(Some(claimed)) => return Remote::Claimed(claimed),
            // Another coordinator was first: it writes the rest, which is followed.
            Ok(None) => {}
            Err(e) => return Remote::Done(Err(attach_error(e))),
        }
    }
    let prompt_tokens = match &found.record.end {
        Some(crate::store::StreamEnd::Finished(f)) => f.prompt_tokens,
        _ => 0,
    };
    let followed = replica
        .follow(&found, msg.after, msg.after_hash, msg.subscriber)
        .await;
    Remote::Done(followed.map(|()| Attached {
        record: found.record,
        prompt_tokens,
    }))
}

impl Handler<Adopt> for Sessions {
    type Result = ();

    fn handle(&mut self, msg: Adopt, ctx: &mut Context<Self>) {
        let effects = self.table.adopt(msg.0, Instant::now());
        self.run(effects, ctx);
    }
}

impl Handler<Detach> for Sessions {
    type Result = ();

    fn handle(&mut self, msg: Detach, ctx: &mut Context<Self>) {
        let effects = self.table.detach(msg.stream, Instant::now());
        self.run(effects, ctx);
    }
}

impl Handler<DispatchTokens> for Sessions {
    type Result = ();

    fn handle(&mut self, msg: DispatchTokens, ctx: &mut Context<Self>) {
        let effects = self.table.tokens(msg.batches, Instant::now());
        self.run(effects, ctx);
    }
}

impl Handler<WorkerLost> for Sessions {
    type Result = ();

    fn handle(&mut self, msg: WorkerLost, ctx: &mut Context<Self>) {
        let effects = self.table.worker_left(msg.worker, Instant::now());
        self.run(effects, ctx);
    }
}
