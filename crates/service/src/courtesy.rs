//! Background threads (KV-event ingest, the fake engines) give the CPU away now and then.
//!
//! Linux's fair scheduler decides again which thread runs on a core only when a thread wakes up
//! or at the core's timer tick (every 4 ms at the common `HZ=250`). A request thread that was
//! preempted, and so waits runnable rather than waking up, can therefore sit behind a busy
//! background thread until the next tick: in an event-storm profile the ingest listener and the
//! applier took both cores for about a tick while the HTTP workers and their client waited
//! runnable, which is the whole of a select's p99 there. A background thread that yields after
//! every stretch of [`STRETCH`] of work lets those waiters run within that stretch; when nothing
//! waits, the yield returns at once (one cheap system call). In storm pairs the yield itself made
//! the difference and the stretch's length hardly mattered (docs/perf-decisions.md); the one
//! chosen bounds the wait well below a quiet `/select` p99.
//!
//! The stretch is counted per thread from the last yield or the last wake-up
//! ([`woke`]; a thread that blocked gave the CPU away anyway).

use std::cell::Cell;
use std::time::{Duration, Instant};

/// Work between two yields of a background thread.
pub const STRETCH: Duration = Duration::from_micros(500);

thread_local! {
    static SINCE: Cell<Option<Instant>> = const { Cell::new(None) };
}

/// The calling thread just woke up (or starts work): its stretch starts now.
pub fn woke() {
    SINCE.with(|s| s.set(Some(Instant::now())));
}

/// After a unit of background work: yields the CPU when the thread has worked for `stretch`
/// since it woke or last yielded. Returns whether it yielded.
pub fn after_work(stretch: Duration) -> bool {
    SINCE.with(|s| {
        let now = Instant::now();
        match s.get() {
            Some(since) if now.duration_since(since) < stretch => false,
            None => {
                s.set(Some(now));
                false
            }
            Some(_) => {
                std::thread::yield_now();
                s.set(Some(Instant::now()));
                true
            }
        }
    })
}

#[cfg(test)]
mod tests {
    use super::{after_work, woke};
    use std::time::{Duration, Instant};

    /// A thread yields only once it has worked a whole stretch since it woke or last yielded.
    #[test]
    fn yields_once_per_stretch_of_work() {
        let stretch = Duration::from_millis(20);
        // The first call starts the stretch.
        assert!(!after_work(stretch));
        assert!(!after_work(stretch));
        let start = Instant::now();
        while start.elapsed() < stretch {
            std::hint::spin_loop();
        }
        assert!(after_work(stretch));
        assert!(!after_work(stretch), "a new stretch starts after a yield");
        std::thread::sleep(stretch);
        woke();
        assert!(!after_work(stretch), "waking up starts a new stretch");
    }
}
