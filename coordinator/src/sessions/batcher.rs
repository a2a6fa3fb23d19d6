//! The batcher: new streams of one model that arrive together share one submit message.
//!
//! A stream goes at once unless a submit for its model went out less than `max_wait`
//! ago; then it waits for that submit's reply, for `max_wait` since it went out, or for
//! the batch to fill, whichever is first. (Not "while a submit is in flight": a worker
//! answers between two engine steps, so a submit stays in flight for most of a step
//! whenever its worker is busy, and every stream arriving then would wait.) A batch holds
//! at most `max_batch` streams and no more than fit in one NATS message.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use baton_common::ids::StreamId;
use tokio::sync::oneshot;

use crate::dispatch::DispatchError;

/// A new stream's answer channel: whether a worker took it (its prompt length).
pub type Reply = oneshot::Sender<Result<u32, DispatchError>>;

/// Bytes a submit's NATS headers may take beside its payload: the fixed part, and each
/// sequence's stream id in the request-id header.
pub(super) const HEADER_BYTES: usize = 256;
pub(super) const HEADER_BYTES_PER_STREAM: usize = 40;

/// A new stream waiting to share a submit.
#[derive(Debug)]
pub struct Waiting {
    /// The stream.
    pub stream: StreamId,
    /// Where its acceptance goes.
    pub reply: Reply,
    /// Its largest submit on the wire, headers included.
    pub bytes: usize,
}

/// What became of a stream just queued.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Queued {
    /// Its batch goes now.
    SendNow,
    /// It opened a batching window: its batch goes after this long (or earlier).
    WakeAfter(Duration),
    /// It joined a window already open.
    Wait,
}

/// How batches are bounded.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// Most streams in one submit.
    pub max_batch: usize,
    /// Longest wait for others to share a submit.
    pub max_wait: Duration,
    /// Largest NATS message.
    pub max_payload: usize,
}

/// New streams waiting, by model, and when each model's last submit went out.
#[derive(Debug, Default)]
pub struct Batcher {
    waiting: HashMap<String, Vec<Waiting>>,
    last_submit: HashMap<String, Instant>,
}

impl Batcher {
    /// Queues `waiting` for `model`'s next submit.
    pub fn push(&mut self, model: &str, waiting: Waiting, now: Instant, limits: Limits) -> Queued {
        let queue = self.waiting.entry(model.to_string()).or_default();
        queue.push(waiting);
        let bytes: usize = queue.iter().map(|w| w.bytes).sum();
        let first = queue.len() == 1;
        let full = queue.len() >= limits.max_batch || bytes >= limits.max_payload;
        let age = self
            .last_submit
            .get(model)
            .map(|t| now.saturating_duration_since(*t));
        match age {
            Some(age) if age < limits.max_wait && !full => match first {
                true => Queued::WakeAfter(limits.max_wait - age),
                false => Queued::Wait,
            },
            _ => Queued::SendNow,
        }
    }

    /// The next batch of `model`: up to `max_batch` streams, as many as fit in one NATS
    /// message (the first always: each fits alone).
    pub fn take(&mut self, model: &str, limits: Limits) -> Vec<Waiting> {
        let Some(queue) = self.waiting.get_mut(model) else {
            return Vec::new();
        };
        let mut take = 0;
        let mut bytes = HEADER_BYTES;
        for w in queue.iter().take(limits.max_batch) {
            if take > 0 && bytes + w.bytes > limits.max_payload {
                break;
            }
            bytes += w.bytes;
            take += 1;
        }
        let batch: Vec<Waiting> = queue.drain(..take).collect();
        if queue.is_empty() {
            self.waiting.remove(model);
        }
        batch
    }

    /// A submit for `model` went out at `now`.
    pub fn submitted(&mut self, model: &str, now: Instant) {
        self.last_submit.insert(model.to_string(), now);
    }

    /// Whether streams of `model` wait.
    pub fn has(&self, model: &str) -> bool {
        self.waiting.contains_key(model)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn waiting(i: u128, bytes: usize) -> Waiting {
        Waiting {
            stream: StreamId(i),
            reply: oneshot::channel().0,
            bytes,
        }
    }

    const LIMITS: Limits = Limits {
        max_batch: 3,
        max_wait: Duration::from_millis(5),
        max_payload: 1000,
    };

    #[test]
    fn a_stream_goes_at_once_unless_a_submit_just_went() {
        let mut b = Batcher::default();
        let t0 = Instant::now();
        assert_eq!(b.push("m", waiting(1, 10), t0, LIMITS), Queued::SendNow);
        assert_eq!(b.take("m", LIMITS).len(), 1);
        b.submitted("m", t0);
        let t1 = t0 + Duration::from_millis(2);
        assert_eq!(
            b.push("m", waiting(2, 10), t1, LIMITS),
            Queued::WakeAfter(Duration::from_millis(3))
        );
        assert_eq!(b.push("m", waiting(3, 10), t1, LIMITS), Queued::Wait);
        // Another model has its own window.
        assert_eq!(b.push("n", waiting(9, 10), t1, LIMITS), Queued::SendNow);
        // The third fills the batch.
        assert_eq!(b.push("m", waiting(4, 10), t1, LIMITS), Queued::SendNow);
        let ids: Vec<u128> = b.take("m", LIMITS).iter().map(|w| w.stream.0).collect();
        assert_eq!(ids, vec![2, 3, 4]);
        assert!(!b.has("m"));
        // After the window, at once again.
        let later = t0 + Duration::from_millis(6);
        assert_eq!(b.push("m", waiting(5, 10), later, LIMITS), Queued::SendNow);
    }

    #[test]
    fn batches_are_bounded_by_bytes_as_well_as_count() {
        let mut b = Batcher::default();
        let t0 = Instant::now();
        b.submitted("m", t0);
        assert!(matches!(
            b.push("m", waiting(1, 600), t0, LIMITS),
            Queued::WakeAfter(_)
        ));
        // Over max_payload together: the batch goes, one message at a time.
        assert_eq!(b.push("m", waiting(2, 600), t0, LIMITS), Queued::SendNow);
        assert_eq!(b.take("m", LIMITS).len(), 1);
        assert!(b.has("m"));
        assert_eq!(b.take("m", LIMITS).len(), 1);
        assert!(!b.has("m"));
        // Small ones share.
        for i in 0..2 {
            b.push("m", waiting(10 + i, 100), t0, LIMITS);
        }
        assert_eq!(b.take("m", LIMITS).len(), 2);
    }
}
