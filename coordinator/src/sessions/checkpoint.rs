//! What the store gives back: streams to run again after a restart, ended streams
//! replayed to a client that reconnects, and ended streams collected after the
//! reconnect window. (Writing checkpoints, with the group commit, is in the table.)

use std::time::Instant;

use baton_common::config::CheckpointMode;
use baton_common::ids::StreamId;

use tracing::{debug, info, warn};

use super::messages::{Attach, AttachError, Attached};
use super::session::{Held, Session, Update};
use super::table::{unix_now, Effect, InFlush, SessionTable};
use crate::replica::Claimed;
use crate::store::{StoredToken, StreamEnd, StreamRecord};
use baton_common::protocol::TokenEvent;

impl SessionTable {
    /// Loads the store's unfinished streams; they are dispatched again (resumed from
    /// their last token) by [`SessionTable::restart`]. Returns how many.
    pub fn recover(&mut self) -> usize {
        let Some(store) = self.store.clone() else {
            return 0;
        };
        let open = match store.unfinished() {
            Ok(open) => open,
            Err(e) => {
                warn!(error = %e, "cannot read unfinished streams from the store");
                return 0;
            }
        };
        for (stream, record) in open {
            let tokens = match store.tokens(stream, 0) {
                Ok(t) => t,
                Err(e) => {
                    warn!(%stream, error = %e, "cannot read a stream's tokens; skipping it");
                    continue;
                }
            };
            self.revive(stream, record, tokens);
        }
        self.recovered.len()
    }

    /// Takes over a stream of a dead coordinator (read from JetStream): kept in the
    /// local store too, and dispatched again at once.
    pub fn adopt(&mut self, claimed: Claimed, now: Instant) -> Vec<Effect> {
        self.at(now);
        let stream = claimed.stream;
        if self.sessions.contains_key(&stream) {
            return self.effects();
        }
        if let Some(store) = &self.store {
            let tokens: Vec<TokenEvent> = claimed
                .tokens
                .iter()
                .cloned()
                .map(TokenEvent::from)
                .collect();
            if let Err(e) = store.adopt(stream, &claimed.record, &tokens) {
                warn!(%stream, error = %e, "cannot keep a stream taken over in the local store");
            }
        }
        self.metrics.taken_over.inc();
        self.revive(stream, claimed.record, claimed.tokens);
        self.restart(now)
    }

    /// Makes a session of a stream read back from a store, to be dispatched again by
    /// [`SessionTable::restart`]; its old attempt is cancelled.
    fn revive(&mut self, stream: StreamId, mut record: StreamRecord, tokens: Vec<StoredToken>) {
        // Keep the longest run of positions 0, 1, 2, … (a damaged tail is regenerated).
        let mut run: Vec<StoredToken> = Vec::with_capacity(tokens.len());
        for t in tokens {
            if t.index as usize != run.len() {
                break;
            }
            run.push(t);
        }
        let old = record.worker.take();
        let attempt = record.attempt;
        let held = run
            .into_iter()
            .map(|t| Held {
                id: t.id,
                hash: t.hash,
                text: t.text,
                logprobs: t.logprobs,
                tool_calls: t.tool_calls,
            })
            .collect();
        let mut session = Session::new(record, held, self.now);
        session.orphan = true;
        if let Some(worker) = old {
            // The old attempt may still run there; it must stop.
            self.cancel(worker, stream, attempt);
        }
        self.sessions.insert(stream, session);
        self.recovered.push(stream);
    }

    /// Dispatches the recovered streams again (the actor has started), each as a new
    /// attempt; with the cancels of their old attempts.
    pub fn restart(&mut self, now: Instant) -> Vec<Effect> {
        self.at(now);
        for stream in std::mem::take(&mut self.recovered) {
            info!(%stream, "dispatching a stream recovered from the store");
            if let Some(s) = self.sessions.get_mut(&stream) {
                s.record.attempt += 1;
                let record = s.record.clone();
                self.persist(stream, &record);
            }
            self.dispatch(stream, None, None);
        }
        self.effects()
    }

    /// Removes from the store the streams that ended before the reconnect window.
    pub fn collect(&self) {
        let Some(store) = &self.store else { return };
        let window = self.settings.reconnect_window.as_secs();
        let before = unix_now().saturating_sub(window);
        match store.collect(before) {
            Ok(collected) => {
                if collected.removed > 0 {
                    debug!(
                        streams = collected.removed,
                        "collected ended streams from the store"
                    );
                }
                self.metrics.store_streams.set(collected.kept as i64);
            }
            Err(e) => warn!(error = %e, "cannot collect the store"),
        }
    }

    /// Replays a stream that ended and left memory, from the store.
    pub(super) fn replay_ended(&self, msg: &Attach) -> Result<Attached, AttachError> {
        let (stream, after, subscriber, access) =
            (msg.stream, msg.after, &msg.subscriber, msg.access);
        let store = self.store.as_ref().ok_or(AttachError::Unknown(stream))?;
        let record = store
            .stream(stream)
            .map_err(|e| AttachError::Store(e.to_string()))?
            .filter(|r| access.allows(r.owner.as_ref()))
            .ok_or(AttachError::Unknown(stream))?;
        let Some(end) = &record.end else {
            return Err(AttachError::Unknown(stream));
        };
        // From the client's last position, to check its chain hash there.
        let tokens = store
            .tokens(stream, after.unwrap_or(0))
            .map_err(|e| AttachError::Store(e.to_string()))?;
        if let (None, Some(p)) = (after, &record.prompt) {
            let _ = subscriber.send(Update::Prompt(p.clone()));
        }
        for t in tokens {
            if Some(t.index) == after {
                if msg.after_hash.is_some_and(|h| h != t.hash) {
                    return Err(AttachError::Diverged(stream, t.index));
                }
                continue;
            }
            let _ = subscriber.send(Update::Token {
                index: t.index,
                text: t.text,
                hash: t.hash,
                logprobs: t.logprobs,
                tool_calls: t.tool_calls,
            });
        }
        let (update, prompt_tokens) = match end {
            StreamEnd::Finished(f) => (Update::Finished(f.clone()), f.prompt_tokens),
            StreamEnd::Failed(e) => (Update::Failed(e.clone()), 0),
        };
        let _ = subscriber.send(update);
        Ok(Attached {
            record,
            prompt_tokens,
        })
    }

    /// Keeps back (in `pending`) the updates of streams whose record is not on disk
    /// yet; returns the others, in order.
    pub(super) fn hold_undurable(
        &mut self,
        updates: Vec<(StreamId, Update)>,
    ) -> Vec<(StreamId, Update)> {
        let (held, ready): (Vec<_>, Vec<_>) = updates
            .into_iter()
            .partition(|(stream, _)| self.sessions.get(stream).is_some_and(|s| !s.durable));
        self.pending.extend(held);
        ready
    }

    /// Starts a flush when there is something to flush and none is running.
    pub(super) fn flush(&mut self) {
        let Some(store) = self.store.clone() else {
            return;
        };
        if self.flushing.is_some() || (self.pending.is_empty() && self.undurable.is_empty()) {
            return;
        }
        self.flushing = Some(InFlush {
            batch: std::mem::take(&mut self.pending),
            covered: std::mem::take(&mut self.undurable),
            started: self.now,
        });
        self.out.push(Effect::Flush(store));
    }

    /// The flush finished: what waited for it goes to clients, and the next one starts
    /// if more arrived meanwhile.
    pub fn flushed(&mut self, result: Result<(), String>, now: Instant) -> Vec<Effect> {
        self.at(now);
        let Some(done) = self.flushing.take() else {
            return self.effects();
        };
        self.metrics
            .checkpoint_flush
            .observe(now.saturating_duration_since(done.started).as_secs_f64());
        if let Err(e) = result {
            warn!(error = %e, "checkpoint flush failed");
        }
        for stream in done.covered {
            if let Some(s) = self.sessions.get_mut(&stream) {
                s.durable = true;
            }
        }
        self.forward(done.batch);
        if self.settings.checkpoint == CheckpointMode::Async {
            // What arrived during the flush for streams now on disk goes out now.
            let held = std::mem::take(&mut self.pending);
            let ready = self.hold_undurable(held);
            self.forward(ready);
        }
        self.flush();
        self.effects()
    }
}
