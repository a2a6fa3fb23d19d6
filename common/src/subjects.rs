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

use crate::ids::{CoordinatorId, WorkerId};

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
        assert_eq!(Subjects::default().prefix(), "baton");
    }
}
