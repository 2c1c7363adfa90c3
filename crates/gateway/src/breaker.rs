//! Per-worker circuit breakers: a worker that keeps failing (connect errors, 5xx, timeouts,
//! failed health checks) is left out of selection for a while, then let through one request
//! at a time (half-open) until one succeeds.
//!
//! ```text
//!            failures ≥ threshold                open_for passed
//!  Closed ─────────────────────────▶ Open ─────────────────────────▶ HalfOpen
//!    ▲                                 ▲                                │
//!    │           success               │   the probe fails              │ one probe dispatched
//!    └─────────────────────────────────┴────────────────────────────────┘
//! ```
//!
//! [`Breaker`] is pure (time is an argument). [`Breakers`] holds one per worker behind one
//! mutex, with a count of breakers that are not plainly healthy so that the usual request, when
//! every worker is healthy, takes no lock at all.

use parking_lot::Mutex;
use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BreakerConfig {
    /// Consecutive failures that open the breaker.
    pub failure_threshold: u32,
    /// How long an open breaker keeps its worker out before a probe.
    pub open_for: Duration,
}

impl Default for BreakerConfig {
    fn default() -> Self {
        Self {
            failure_threshold: 3,
            open_for: Duration::from_secs(10),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BreakerState {
    Closed,
    Open {
        until: Instant,
    },
    /// One probe may go; `probe_since` is when the one in flight went (a probe that never
    /// reports, such as one whose client left, is given up after `open_for`).
    HalfOpen {
        probe_since: Option<Instant>,
    },
}

/// One worker's breaker.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Breaker {
    pub state: BreakerState,
    pub consecutive_failures: u32,
}

impl Default for Breaker {
    fn default() -> Self {
        Self {
            state: BreakerState::Closed,
            consecutive_failures: 0,
        }
    }
}

impl Breaker {
    /// Whether a request may go to the worker now (moving an open breaker whose time is up to
    /// half-open).
    pub fn admits(&mut self, config: &BreakerConfig, now: Instant) -> bool {
        match self.state {
            BreakerState::Closed => true,
            BreakerState::Open { until } if now >= until => {
                self.state = BreakerState::HalfOpen { probe_since: None };
                true
            }
            BreakerState::Open { .. } => false,
            BreakerState::HalfOpen { probe_since: None } => true,
            BreakerState::HalfOpen {
                probe_since: Some(since),
            } => now.saturating_duration_since(since) >= config.open_for,
        }
    }

    /// A request went to the worker: in half-open, it is the probe.
    pub fn dispatched(&mut self, now: Instant) {
        if let BreakerState::HalfOpen { .. } = self.state {
            self.state = BreakerState::HalfOpen {
                probe_since: Some(now),
            };
        }
    }

    pub fn succeeded(&mut self) {
        *self = Self::default();
    }

    /// Returns whether this failure opened the breaker.
    pub fn failed(&mut self, config: &BreakerConfig, now: Instant) -> bool {
        self.consecutive_failures = self.consecutive_failures.saturating_add(1);
        let open = match self.state {
            BreakerState::HalfOpen { .. } => true,
            BreakerState::Closed => self.consecutive_failures >= config.failure_threshold,
            BreakerState::Open { .. } => false,
        };
        if open {
            self.state = BreakerState::Open {
                until: now + config.open_for,
            };
        }
        open
    }

    fn is_healthy(&self) -> bool {
        self.state == BreakerState::Closed && self.consecutive_failures == 0
    }
}

/// The breakers of every worker that has failed since it last succeeded.
#[derive(Debug, Default)]
pub struct Breakers {
    config: BreakerConfig,
    /// Only workers that are not healthy have an entry.
    breakers: Mutex<HashMap<u64, Breaker>>,
    /// `breakers.len()`, read without the lock.
    unhealthy: AtomicUsize,
}

impl Breakers {
    pub fn new(config: BreakerConfig) -> Self {
        Self {
            config,
            ..Self::default()
        }
    }

    pub fn config(&self) -> &BreakerConfig {
        &self.config
    }

    /// The workers whose breaker refuses a request now; empty (and no lock taken) while every
    /// worker is healthy.
    pub fn refused(&self, now: Instant) -> Vec<u64> {
        if self.unhealthy.load(Ordering::Relaxed) == 0 {
            return Vec::new();
        }
        let mut breakers = self.breakers.lock();
        breakers
            .iter_mut()
            .filter_map(|(id, b)| (!b.admits(&self.config, now)).then_some(*id))
            .collect()
    }

    pub fn dispatched(&self, worker_id: u64, now: Instant) {
        if self.unhealthy.load(Ordering::Relaxed) == 0 {
            return;
        }
        if let Some(b) = self.breakers.lock().get_mut(&worker_id) {
            b.dispatched(now);
        }
    }

    pub fn succeeded(&self, worker_id: u64) {
        if self.unhealthy.load(Ordering::Relaxed) == 0 {
            return;
        }
        let mut breakers = self.breakers.lock();
        if let Some(b) = breakers.get_mut(&worker_id) {
            b.succeeded();
            breakers.remove(&worker_id);
            self.unhealthy.store(breakers.len(), Ordering::Relaxed);
        }
    }

    /// A passed health check: clears a closed breaker's failures, and counts as the probe of
    /// an open one whose time is up (never earlier).
    pub fn health_ok(&self, worker_id: u64, now: Instant) {
        if self.unhealthy.load(Ordering::Relaxed) == 0 {
            return;
        }
        let mut breakers = self.breakers.lock();
        if breakers
            .get_mut(&worker_id)
            .is_some_and(|b| b.admits(&self.config, now))
        {
            breakers.remove(&worker_id);
            self.unhealthy.store(breakers.len(), Ordering::Relaxed);
        }
    }

    /// Returns whether this failure opened the worker's breaker.
    pub fn failed(&self, worker_id: u64, now: Instant) -> bool {
        let mut breakers = self.breakers.lock();
        let opened = breakers
            .entry(worker_id)
            .or_default()
            .failed(&self.config, now);
        self.unhealthy.store(breakers.len(), Ordering::Relaxed);
        opened
    }

    /// A worker's breaker (a healthy one when it has no entry).
    pub fn get(&self, worker_id: u64) -> Breaker {
        self.breakers
            .lock()
            .get(&worker_id)
            .copied()
            .unwrap_or_default()
    }

    /// Forgets a worker that left the catalog.
    pub fn forget(&self, worker_id: u64) {
        let mut breakers = self.breakers.lock();
        breakers.remove(&worker_id);
        self.unhealthy.store(breakers.len(), Ordering::Relaxed);
    }

    /// Workers whose breaker is open or half-open, for the metrics.
    pub fn open_count(&self) -> usize {
        if self.unhealthy.load(Ordering::Relaxed) == 0 {
            return 0;
        }
        self.breakers
            .lock()
            .values()
            .filter(|b| !b.is_healthy() && b.state != BreakerState::Closed)
            .count()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config() -> BreakerConfig {
        BreakerConfig {
            failure_threshold: 2,
            open_for: Duration::from_secs(10),
        }
    }

    #[test]
    fn opens_after_the_threshold_probes_after_the_wait_and_recovers() {
        let c = config();
        let t0 = Instant::now();
        let mut b = Breaker::default();
        assert!(!b.failed(&c, t0));
        assert!(b.admits(&c, t0), "one failure is below the threshold");
        assert!(b.failed(&c, t0));
        assert!(!b.admits(&c, t0 + Duration::from_secs(9)));
        // Time is up: one probe may go.
        let t1 = t0 + Duration::from_secs(10);
        assert!(b.admits(&c, t1));
        b.dispatched(t1);
        assert!(!b.admits(&c, t1), "only one probe at a time");
        b.succeeded();
        assert_eq!(b, Breaker::default());
    }

    #[test]
    fn a_failed_probe_opens_again_and_a_lost_probe_is_given_up() {
        let c = config();
        let t0 = Instant::now();
        let mut b = Breaker::default();
        b.failed(&c, t0);
        b.failed(&c, t0);
        let t1 = t0 + Duration::from_secs(10);
        assert!(b.admits(&c, t1));
        b.dispatched(t1);
        assert!(b.failed(&c, t1), "a failed probe reopens at once");
        assert!(!b.admits(&c, t1 + Duration::from_secs(5)));
        let t2 = t1 + Duration::from_secs(10);
        assert!(b.admits(&c, t2));
        b.dispatched(t2);
        assert!(!b.admits(&c, t2 + Duration::from_secs(9)));
        assert!(
            b.admits(&c, t2 + Duration::from_secs(10)),
            "a probe that never reported is given up"
        );
    }

    #[test]
    fn the_map_takes_no_entry_for_healthy_workers() {
        let breakers = Breakers::new(config());
        let t0 = Instant::now();
        assert!(breakers.refused(t0).is_empty());
        breakers.failed(7, t0);
        assert!(breakers.refused(t0).is_empty(), "below the threshold");
        breakers.failed(7, t0);
        assert_eq!(breakers.refused(t0), vec![7]);
        assert_eq!(breakers.open_count(), 1);
        breakers.succeeded(7);
        assert!(breakers.refused(t0).is_empty());
        assert_eq!(breakers.unhealthy.load(Ordering::Relaxed), 0);
    }
}
