//! `--gateway-policy round-robin`: each model's workers in turn, whatever they cache.
//!
//! 1. One counter for the gateway, taken (and advanced) once per booking attempt.
//! 2. The model's schedulable workers, less those refused (breakers, failed connections), in
//!    the catalog's order; the counter modulo their number picks one.
//! 3. That worker is pinned: the selector books it without scoring, so its load is booked,
//!    driven and freed like any other. The prompt is not tokenized: its length, estimated
//!    from the body's size, is booked as load.
//!
//! A baseline for the cache-aware policy, not a balancer: a slow worker gets its turn anyway.

use std::sync::atomic::{AtomicUsize, Ordering};

/// The turn of the next booking.
#[derive(Debug, Default)]
pub struct RoundRobin {
    next_worker: AtomicUsize,
}

impl RoundRobin {
    /// Round robin reads no cache: the prompt's length is only booked as load.
    pub fn reads_prompt(&self) -> bool {
        false
    }

    /// The next of `workers` in turn; `None` when there are none (the selector then answers
    /// as for any request it cannot place).
    pub fn pin(&self, workers: &[u64]) -> Option<u64> {
        let turn = self.next_worker.fetch_add(1, Ordering::Relaxed);
        workers.get(turn % workers.len().max(1)).copied()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn workers_take_turns_and_none_is_none() {
        let policy = RoundRobin::default();
        let picks: Vec<Option<u64>> = (0..4).map(|_| policy.pin(&[7, 8, 9])).collect();
        assert_eq!(picks, [Some(7), Some(8), Some(9), Some(7)]);
        assert_eq!(policy.pin(&[]), None);
        // The turn moves on whatever the list: a shorter list is taken modulo its length.
        assert_eq!(policy.pin(&[1, 2]), Some(2));
    }
}
