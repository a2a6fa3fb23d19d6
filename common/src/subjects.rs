//! NATS subject names, built in one place.
//!
//! Everything lives under one configurable prefix (default `baton`):
//!
//! | subject | publisher | message |
//! | --- | --- | --- |
//! | `<p>.v1.workers.heartbeat` | workers | [`crate::protocol::Heartbeat`] |
//! | `<p>.v1.worker.<id>.submit` | coordinators | [`crate::protocol::Submit`] (request/reply: [`crate::protocol::SubmitReply`]) |
//! | `<p>.v1.worker.<id>.cancel` | coordinators | [`crate::protocol::Cancel`] |
//! | `<p>.v1.coord.<id>.tokens` | workers | [`crate::protocol::TokenBatch`] |
//! | `<p>.v1.completions` | NATS clients | public API, JSON (queue group [`crate::public::QUEUE_GROUP`]) |
//! | `<p>.v1.chat.completions` | NATS clients | public API, JSON (queue group) |
//! | `<p>.v1.streams.replay` | NATS clients | a stream again, after a position (queue group) |
//! | `<p>.v1.coord.<id>.replay` | coordinators | a replay forwarded to the stream's coordinator |
//! | `<p>.v1.admin.status` | operators | workers, models, load (queue group) |
//! | `<p>.v1.admin.drain` | operators | drain one worker (queue group) |
//!
//! `docs/protocol.md` describes every message.

use crate::ids::{CoordinatorId, StreamId, WorkerId};

/// NATS header naming the request a message belongs to (its stream id): coordinator and
/// worker both log it, so one search follows a request through both.
pub const REQUEST_ID_HEADER: &str = "Baton-Request-Id";

/// Default subject prefix.
pub const DEFAULT_PREFIX: &str = "baton";

/// Builds every subject of one cluster.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Subjects {
    prefix: String,
}

impl Default for Subjects {
    fn default() -> Self {
        Self::new(DEFAULT_PREFIX)
    }
}

impl Subjects {
    /// Subjects under `prefix` (a NATS token sequence without wildcards).
    pub fn new(prefix: impl Into<String>) -> Self {
        Self {
            prefix: prefix.into(),
        }
    }

    /// The prefix.
    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    /// A stream's checkpoint in JetStream: its token batches, then its end.
    pub fn checkpoint(&self, stream: StreamId) -> String {
        format!("{}.v1.checkpoint.{stream}", self.prefix)
    }

    /// Every stream's checkpoint (the subjects of the JetStream stream that holds them).
    pub fn all_checkpoints(&self) -> String {
        format!("{}.v1.checkpoint.*", self.prefix)
    }

    /// The name of one of this cluster's JetStream streams or key-value buckets: the
    /// prefix with every character JetStream does not allow in names as `_`, then
    /// `_what`.
    pub fn jetstream_name(&self, what: &str) -> String {
        let prefix: String = self
            .prefix
            .chars()
            .map(|c| {
                if c.is_ascii_alphanumeric() || c == '-' {
                    c
                } else {
                    '_'
                }
            })
            .collect();
        format!("{prefix}_{what}")
    }

    /// Where workers announce themselves.
    pub fn heartbeat(&self) -> String {
        format!("{}.v1.workers.heartbeat", self.prefix)
    }

    /// Where a worker takes new sequences (request/reply).
    pub fn submit(&self, worker: WorkerId) -> String {
        format!("{}.v1.worker.{worker}.submit", self.prefix)
    }

    /// Where a worker takes cancellations.
    pub fn cancel(&self, worker: WorkerId) -> String {
        format!("{}.v1.worker.{worker}.cancel", self.prefix)
    }

    /// Where a coordinator receives its streams' tokens.
    pub fn tokens(&self, coordinator: CoordinatorId) -> String {
        format!("{}.v1.coord.{coordinator}.tokens", self.prefix)
    }

    /// Every coordinator's token subject (`<p>.v1.coord.*.tokens`): a wildcard, for
    /// observers that check what workers send (the soak's token tap).
    pub fn all_tokens(&self) -> String {
        format!("{}.v1.coord.*.tokens", self.prefix)
    }

    /// Public API: text completions (`/v1/completions` over NATS).
    pub fn completions(&self) -> String {
        format!("{}.v1.completions", self.prefix)
    }

    /// Public API: chat completions (`/v1/chat/completions` over NATS).
    pub fn chat_completions(&self) -> String {
        format!("{}.v1.chat.completions", self.prefix)
    }

    /// Public API: token ids of a prompt or messages (`/tokenize` over NATS).
    pub fn tokenize(&self) -> String {
        format!("{}.v1.tokenize", self.prefix)
    }

    /// Public API: the text of token ids (`/detokenize` over NATS).
    pub fn detokenize(&self) -> String {
        format!("{}.v1.detokenize", self.prefix)
    }

    /// Public API: replay a stream after a position, served by any coordinator.
    pub fn replay(&self) -> String {
        format!("{}.v1.streams.replay", self.prefix)
    }

    /// A replay addressed to the coordinator that holds the stream.
    pub fn coordinator_replay(&self, coordinator: CoordinatorId) -> String {
        format!("{}.v1.coord.{coordinator}.replay", self.prefix)
    }

    /// Admin: the cluster's state as one coordinator sees it.
    pub fn admin_status(&self) -> String {
        format!("{}.v1.admin.status", self.prefix)
    }

    /// Admin: drain one worker.
    pub fn admin_drain(&self) -> String {
        format!("{}.v1.admin.drain", self.prefix)
    }

    /// Admin: load a model file on one worker.
    pub fn admin_load_model(&self) -> String {
        format!("{}.v1.admin.models.load", self.prefix)
    }

    /// Admin: stop serving a model on one worker.
    pub fn admin_unload_model(&self) -> String {
        format!("{}.v1.admin.models.unload", self.prefix)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn subjects_have_the_documented_shape() {
        let s = Subjects::new("acme");
        let w = WorkerId(0xab);
        assert_eq!(s.heartbeat(), "acme.v1.workers.heartbeat");
        assert_eq!(
            s.submit(w),
            "acme.v1.worker.000000000000000000000000000000ab.submit"
        );
        assert!(s.cancel(w).ends_with(".cancel"));
        assert!(s.tokens(CoordinatorId(1)).starts_with("acme.v1.coord."));
        assert_eq!(s.all_tokens(), "acme.v1.coord.*.tokens");
        assert_eq!(Subjects::default().prefix(), "baton");
        assert_eq!(s.completions(), "acme.v1.completions");
        assert_eq!(s.chat_completions(), "acme.v1.chat.completions");
        assert_eq!(s.replay(), "acme.v1.streams.replay");
        assert_eq!(s.tokenize(), "acme.v1.tokenize");
        assert_eq!(s.detokenize(), "acme.v1.detokenize");
        assert_eq!(
            s.coordinator_replay(CoordinatorId(2)),
            "acme.v1.coord.00000000000000000000000000000002.replay"
        );
        assert_eq!(s.admin_status(), "acme.v1.admin.status");
        assert_eq!(s.admin_drain(), "acme.v1.admin.drain");
        assert_eq!(s.admin_load_model(), "acme.v1.admin.models.load");
        assert_eq!(s.admin_unload_model(), "acme.v1.admin.models.unload");
    }
}
