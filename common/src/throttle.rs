//! Warnings that a remote party can repeat at will (garbage on a NATS subject) are
//! logged at most once per interval, each saying how many like it were held back: the
//! counters in the metrics still count every one.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::LazyLock;
use std::time::{Duration, Instant};

/// Lets a repeated warning through at most once per interval.
#[derive(Debug)]
pub struct Throttle {
    interval: Duration,
    /// When the next warning may go out, in milliseconds since [`START`].
    next_ms: AtomicU64,
    /// Warnings held back since the last one that went out.
    held: AtomicU64,
}

/// The origin of every throttle's clock.
static START: LazyLock<Instant> = LazyLock::new(Instant::now);

impl Throttle {
    /// One warning per `interval`.
    pub const fn new(interval: Duration) -> Self {
        Self {
            interval,
            next_ms: AtomicU64::new(0),
            held: AtomicU64::new(0),
        }
    }

    /// `Some(held)` when a warning may go out now (`held`: how many were held back since
    /// the last one), else `None` (and this one is counted as held back).
    pub fn admit(&self) -> Option<u64> {
        let now = u64::try_from(START.elapsed().as_millis()).unwrap_or(u64::MAX);
        let next = self.next_ms.load(Ordering::Relaxed);
        let step = u64::try_from(self.interval.as_millis()).unwrap_or(u64::MAX);
        let due = now >= next
            && self
                .next_ms
                .compare_exchange(
                    next,
                    now.saturating_add(step),
                    Ordering::Relaxed,
                    Ordering::Relaxed,
                )
                .is_ok();
        if due {
            Some(self.held.swap(0, Ordering::Relaxed))
        } else {
            self.held.fetch_add(1, Ordering::Relaxed);
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_warning_an_interval_and_a_count_of_the_rest() {
        let t = Throttle::new(Duration::from_millis(200));
        assert_eq!(t.admit(), Some(0));
        for _ in 0..1000 {
            assert_eq!(t.admit(), None);
        }
        std::thread::sleep(Duration::from_millis(250));
        assert_eq!(t.admit(), Some(1000));
        assert_eq!(t.admit(), None);
    }
}
