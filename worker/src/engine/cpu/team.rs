//! One parallel region per forward pass: every thread of the rayon pool runs the same
//! sequence of phases, taking chunks of each phase's work from a shared counter, and
//! the threads meet at a spinning barrier between phases.
//!
//! A rayon fork/join per matrix product costs a wake-up of the sleeping workers each
//! time (five products a layer); here the workers are woken once per forward pass and
//! wait for each other by spinning, then yielding, a few hundred nanoseconds a phase.

use std::{
    cell::UnsafeCell,
    sync::atomic::{AtomicBool, AtomicUsize, Ordering},
};

/// Spins before a waiting thread starts yielding its core.
const SPINS_BEFORE_YIELD: u32 = 1 << 14;

/// Waits until `done` holds: spins, then yields its core; panics with `why` once
/// `poisoned` is set (a thread it waits for panicked) instead of waiting forever.
fn spin_until(done: impl Fn() -> bool, poisoned: &AtomicBool, why: &str) {
    let mut spins = 0u32;
    while !done() {
        assert!(!poisoned.load(Ordering::Relaxed), "{why}");
        if spins < SPINS_BEFORE_YIELD {
            spins += 1;
            std::hint::spin_loop();
        } else {
            std::thread::yield_now();
        }
    }
}

/// A reusable barrier for a fixed number of threads that spins, then yields.
///
/// If a thread panics inside the region, its [`PanicGuard`] poisons the barrier and
/// the other threads panic at their next wait instead of waiting forever.
pub(crate) struct SpinBarrier {
    threads: usize,
    arrived: AtomicUsize,
    generation: AtomicUsize,
    poisoned: AtomicBool,
}

impl SpinBarrier {
    pub(crate) fn new(threads: usize) -> Self {
        Self {
            threads: threads.max(1),
            arrived: AtomicUsize::new(0),
            generation: AtomicUsize::new(0),
            poisoned: AtomicBool::new(false),
        }
    }

    /// Blocks until every thread has called `wait` for this phase. Writes made before
    /// the wait by any thread are visible to every thread after it.
    pub(crate) fn wait(&self) {
        let gen = self.generation.load(Ordering::Acquire);
        if self.arrived.fetch_add(1, Ordering::AcqRel) + 1 == self.threads {
            self.arrived.store(0, Ordering::Relaxed);
            self.generation
                .store(gen.wrapping_add(1), Ordering::Release);
            return;
        }
        spin_until(
            || self.generation.load(Ordering::Acquire) != gen,
            &self.poisoned,
            "another thread of the forward pass panicked",
        );
    }

    /// A guard that poisons the barrier if its thread unwinds.
    pub(crate) fn guard(&self) -> PanicGuard<'_> {
        PanicGuard(self)
    }
}

/// Poisons its barrier when dropped during a panic.
pub(crate) struct PanicGuard<'a>(&'a SpinBarrier);

impl Drop for PanicGuard<'_> {
    fn drop(&mut self) {
        if std::thread::panicking() {
            self.0.poisoned.store(true, Ordering::Relaxed);
        }
    }
}

/// A value one thread of a region sets once and the others wait for, spinning, then
/// yielding (as [`SpinBarrier`] waits).
///
/// If the setting thread panics before it sets the value, its [`LatchGuard`] poisons
/// the latch and the waiting threads panic instead of waiting forever.
pub(crate) struct Latch<T> {
    value: std::sync::OnceLock<T>,
    poisoned: AtomicBool,
}

impl<T> Default for Latch<T> {
    fn default() -> Self {
        Self {
            value: std::sync::OnceLock::new(),
            poisoned: AtomicBool::new(false),
        }
    }
}

impl<T> Latch<T> {
    /// Sets the value (a second set is ignored).
    pub(crate) fn set(&self, value: T) {
        let _ = self.value.set(value);
    }

    /// The value, once it is set.
    pub(crate) fn wait(&self) -> &T {
        spin_until(
            || self.value.get().is_some(),
            &self.poisoned,
            "the thread that owed this value panicked",
        );
        self.value.get().expect("set, by the wait above")
    }

    /// A guard for the thread that sets the value: it poisons the latch if the thread
    /// unwinds first.
    pub(crate) fn guard(&self) -> LatchGuard<'_, T> {
        LatchGuard(self)
    }
}

/// Poisons its latch when dropped during a panic.
pub(crate) struct LatchGuard<'a, T>(&'a Latch<T>);

impl<T> Drop for LatchGuard<'_, T> {
    fn drop(&mut self) {
        if std::thread::panicking() {
            self.0.poisoned.store(true, Ordering::Relaxed);
        }
    }
}

/// Work counters, one per phase of a region: threads take items with [`Counters::next`]
/// until the phase's items are gone.
pub(crate) struct Counters(Vec<AtomicUsize>);

impl Counters {
    pub(crate) fn new(phases: usize) -> Self {
        Self((0..phases).map(|_| AtomicUsize::new(0)).collect())
    }

    /// The next unclaimed item of `phase`, if any is below `items`.
    pub(crate) fn next(&self, phase: usize, items: usize) -> Option<usize> {
        let i = self.0[phase].fetch_add(1, Ordering::Relaxed);
        (i < items).then_some(i)
    }
}

/// An f32 buffer that the threads of a region write in disjoint parts.
///
/// The region's phases decide who writes what: within a phase no two threads touch the
/// same element unless all of them only read it, and a barrier separates the phases.
pub(crate) struct Shared<'a, T = f32> {
    cells: &'a [UnsafeCell<T>],
}

// SAFETY: access is coordinated by the region's phases and barriers as documented on
// the type; the barrier's acquire/release orderings publish each phase's writes.
unsafe impl<T: Send> Sync for Shared<'_, T> {}

impl<'a, T> Shared<'a, T> {
    pub(crate) fn new(buf: &'a mut [T]) -> Self {
        let len = buf.len();
        let ptr = buf.as_mut_ptr() as *const UnsafeCell<T>;
        // SAFETY: `UnsafeCell<f32>` has the layout of `f32`, and the exclusive borrow of
        // `buf` is held for `'a`, so nothing else reaches these elements meanwhile.
        let cells = unsafe { std::slice::from_raw_parts(ptr, len) };
        Self { cells }
    }

    /// How many elements the buffer holds.
    pub(crate) fn len(&self) -> usize {
        self.cells.len()
    }

    /// Elements `range`, to read.
    ///
    /// # Safety
    /// No thread writes these elements during the current phase.
    pub(crate) unsafe fn get(&self, range: std::ops::Range<usize>) -> &[T] {
        let cells = &self.cells[range];
        // SAFETY: in bounds (indexed above); no concurrent writer by the contract.
        unsafe { std::slice::from_raw_parts(cells.as_ptr() as *const T, cells.len()) }
    }

    /// Elements `range`, to write.
    ///
    /// # Safety
    /// No other thread reads or writes these elements during the current phase.
    #[allow(clippy::mut_from_ref)]
    pub(crate) unsafe fn get_mut(&self, range: std::ops::Range<usize>) -> &mut [T] {
        let cells = &self.cells[range];
        // SAFETY: in bounds (indexed above); this thread is the only one touching them
        // by the contract.
        unsafe { std::slice::from_raw_parts_mut(UnsafeCell::raw_get(cells.as_ptr()), cells.len()) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn phases_see_each_others_writes() {
        let threads = rayon::current_num_threads();
        let barrier = SpinBarrier::new(threads);
        let counters = Counters::new(64);
        let mut buf = vec![0.0f32; 1000];
        let shared = Shared::new(&mut buf);
        rayon::broadcast(|_| {
            let _guard = barrier.guard();
            for phase in 0..64 {
                // Each phase adds one to every element, reading what the last wrote.
                while let Some(i) = counters.next(phase, shared.len()) {
                    // SAFETY: item `i` is claimed by this thread alone in this phase.
                    let v = unsafe { shared.get_mut(i..i + 1) };
                    v[0] += 1.0;
                }
                barrier.wait();
            }
        });
        assert!(buf.iter().all(|&v| v == 64.0));
    }

    #[test]
    fn a_latch_hands_its_value_to_every_thread() {
        let latch = Latch::default();
        let seen = AtomicUsize::new(0);
        rayon::broadcast(|ctx| {
            if ctx.index() == 0 {
                let _guard = latch.guard();
                latch.set(41usize);
            }
            seen.fetch_add(*latch.wait(), Ordering::Relaxed);
        });
        assert_eq!(seen.into_inner(), 41 * rayon::current_num_threads());
    }

    #[test]
    fn a_latch_whose_owner_panics_fails_its_waiters() {
        let latch = Latch::<u32>::default();
        let owner = std::thread::scope(|s| {
            s.spawn(|| {
                let _guard = latch.guard();
                panic!("the owner fails before it sets the value");
            })
            .join()
        });
        assert!(owner.is_err());
        let waiter = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| *latch.wait()));
        assert!(waiter.is_err(), "a waiter must not wait forever");
    }
}
