//! The threads that run the model on CPU: the process's rayon pool, its threads named
//! `baton-compute-N` and run in the scheduling class the worker is configured with.
//!
//! A CPU worker keeps every core busy while it decodes. Its own network threads, a
//! coordinator or a nats-server on the same host then wait for a core at each message
//! unless the compute threads give way: under `SCHED_IDLE` (the default) any other
//! runnable thread preempts them at once, so a token leaves, and a request arrives,
//! without waiting out a compute thread's time slice. The price: on a host shared with
//! other CPU-heavy work the compute threads get only the cores that work leaves idle;
//! there, `normal` shares the cores fairly instead.

use std::str::FromStr;

/// Scheduling class of the compute threads.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ComputePriority {
    /// Linux `SCHED_IDLE`: every other runnable thread goes first.
    #[default]
    Idle,
    /// The process's own class and nice value.
    Normal,
}

impl FromStr for ComputePriority {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "idle" => Ok(ComputePriority::Idle),
            "normal" => Ok(ComputePriority::Normal),
            other => Err(format!(
                "unknown compute priority {other:?} (expected idle or normal)"
            )),
        }
    }
}

impl ComputePriority {
    /// Puts the calling thread in this class.
    fn apply(self) -> std::io::Result<()> {
        match self {
            ComputePriority::Normal => Ok(()),
            ComputePriority::Idle => set_idle(),
        }
    }
}

#[cfg(target_os = "linux")]
fn set_idle() -> std::io::Result<()> {
    let param = libc::sched_param { sched_priority: 0 };
    // SAFETY: `param` is a valid `sched_param`; pid 0 is the calling thread, and moving
    // a thread to a lower class needs no privilege.
    if unsafe { libc::sched_setscheduler(0, libc::SCHED_IDLE, &param) } == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

#[cfg(not(target_os = "linux"))]
fn set_idle() -> std::io::Result<()> {
    Err(std::io::Error::new(
        std::io::ErrorKind::Unsupported,
        "SCHED_IDLE exists on Linux only",
    ))
}

/// A pool of `threads` compute threads (0: `RAYON_NUM_THREADS`, else one per core) in
/// class `priority`. A thread that cannot change class logs why and runs as it is.
pub fn pool_builder(threads: usize, priority: ComputePriority) -> rayon::ThreadPoolBuilder {
    rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .thread_name(|i| format!("baton-compute-{i}"))
        .start_handler(move |i| {
            if let Err(e) = priority.apply() {
                tracing::warn!(thread = i, error = %e, ?priority, "compute thread keeps its class");
            }
        })
}

/// Makes the process's rayon pool the compute pool. Call it before anything uses rayon:
/// a pool that already exists stays as it is (logged).
pub fn init(threads: usize, priority: ComputePriority) {
    match pool_builder(threads, priority).build_global() {
        Ok(()) => tracing::info!(
            threads = rayon::current_num_threads(),
            ?priority,
            "compute threads started"
        ),
        Err(e) => tracing::warn!(error = %e, "compute threads were already started"),
    }
}

#[cfg(all(test, target_os = "linux"))]
mod tests {
    use super::*;

    /// The class and name of every thread of a pool built with `priority`.
    fn classes(priority: ComputePriority) -> Vec<(i32, String)> {
        let pool = pool_builder(2, priority).build().expect("pool");
        pool.broadcast(|_| {
            // SAFETY: plain query about the calling thread.
            let class = unsafe { libc::sched_getscheduler(0) };
            let name = std::thread::current().name().unwrap_or("").to_string();
            (class, name)
        })
    }

    #[test]
    fn compute_threads_take_the_configured_class() {
        let idle = classes(ComputePriority::Idle);
        assert_eq!(idle.len(), 2);
        for (class, name) in &idle {
            assert_eq!(*class, libc::SCHED_IDLE, "thread {name}");
            assert!(name.starts_with("baton-compute-"), "thread name {name}");
        }
        // SAFETY: plain query about the calling thread.
        let own = unsafe { libc::sched_getscheduler(0) };
        for (class, name) in classes(ComputePriority::Normal) {
            assert_eq!(class, own, "thread {name} keeps the process's class");
        }
    }

    #[test]
    fn priorities_parse_by_name() {
        assert_eq!("idle".parse(), Ok(ComputePriority::Idle));
        assert_eq!("normal".parse(), Ok(ComputePriority::Normal));
        assert!("realtime".parse::<ComputePriority>().is_err());
        assert_eq!(ComputePriority::default(), ComputePriority::Idle);
    }
}
