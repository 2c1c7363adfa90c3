//! Routing that has gone blind: the workers whose cache the router can no longer see, and why.
//!
//! A KV-aware router degrades silently: when a worker's KV events never arrive, or arrive for
//! blocks of another size than the worker registered, or the gateway's tokens are not the
//! engine's, every overlap is zero and routing falls back to load balancing with nothing in the
//! logs. This registry holds, per worker, the reasons it is degraded now and a sentence saying
//! what to fix, and turns each into:
//!
//! - the gauge `kvroute_routing_degraded{worker, reason}`: 1 while degraded, 0 once cleared;
//! - one warning when a reason is raised (an info line when it clears);
//! - `"degraded"` on the worker's ranks in `GET /loads` (only while non-empty), which the
//!   status page shows as a banner.
//!
//! Who raises what:
//!
//! | reason | raised by | when | cleared when |
//! |---|---|---|---|
//! | `no_kv_events` | the housekeeping tick ([`Degradation::check`]) | a worker with a KV-event endpoint got at least `bookings` bookings over at least `window` and no KV-event message since the first of them | a message arrives, or the worker's endpoints change |
//! | `block_size_mismatch` | the KV-event listener | a `BlockStored` carries another `block_size` than the worker registered | a `BlockStored` of the registered size arrives, or the worker re-registers with another size |
//! | `tokenizer_mismatch`, `cache_mismatch` | the gateway (`kvroute-gateway`'s `mismatch`), through [`crate::Service`] | its answers' `usage` disagree with its own counts | they agree again |
//!
//! Cost: one short mutex per KV-event message, per booking and per tick (a pass over the
//! workers); nothing on the select path.

use kvroute_core::selector::WorkerRecord;
use parking_lot::Mutex;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use std::collections::{BTreeMap, HashMap};
use std::time::{Duration, Instant};

/// Why a worker's routing is degraded.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Reason {
    /// The worker takes bookings and its KV events stay silent.
    NoKvEvents,
    /// Its KV events' blocks are of another size than it registered.
    BlockSizeMismatch,
    /// The engine counts other prompt tokens than the gateway's tokenizer.
    TokenizerMismatch,
    /// The engine's cached prompt tokens disagree with the overlap the router predicted.
    CacheMismatch,
}

impl Reason {
    pub const ALL: [Reason; 4] = [
        Reason::NoKvEvents,
        Reason::BlockSizeMismatch,
        Reason::TokenizerMismatch,
        Reason::CacheMismatch,
    ];

    /// The label value and the JSON string.
    pub fn as_str(self) -> &'static str {
        match self {
            Reason::NoKvEvents => "no_kv_events",
            Reason::BlockSizeMismatch => "block_size_mismatch",
            Reason::TokenizerMismatch => "tokenizer_mismatch",
            Reason::CacheMismatch => "cache_mismatch",
        }
    }
}

impl std::fmt::Display for Reason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One reason a worker is degraded now, and what to fix.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Degraded {
    pub reason: Reason,
    /// One sentence naming the worker, what was seen and what to check.
    pub message: String,
}

/// `no_kv_events`: this many bookings over at least this long with no KV-event message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SilenceRule {
    pub window: Duration,
    pub bookings: u64,
}

impl Default for SilenceRule {
    fn default() -> Self {
        Self {
            window: Duration::from_secs(30),
            bookings: 20,
        }
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct DegradedLabels {
    pub worker: String,
    pub reason: &'static str,
}

/// What is watched of one worker.
#[derive(Debug, Default)]
struct Watch {
    /// The first KV-event endpoint its listeners connect to; `None`: no listener, so its
    /// silence means nothing.
    events_endpoint: Option<String>,
    /// The block size it registered (0: unknown).
    block_size: u32,
    /// Bookings since its last KV-event message (or since it was registered).
    bookings_since_event: u64,
    first_booking_since_event: Option<Instant>,
    reasons: BTreeMap<Reason, String>,
}

/// The registry: the workers' degradations, the gauge, the log lines.
#[derive(Debug, Default)]
pub struct Degradation {
    workers: Mutex<HashMap<u64, Watch>>,
    gauge: Family<DegradedLabels, Gauge>,
    /// `None`: `no_kv_events` is never raised.
    silence: Mutex<Option<SilenceRule>>,
}

impl Degradation {
    pub fn new() -> Self {
        Self {
            silence: Mutex::new(Some(SilenceRule::default())),
            ..Self::default()
        }
    }

    /// The gauge, for the service's registry.
    pub fn gauge(&self) -> Family<DegradedLabels, Gauge> {
        self.gauge.clone()
    }

    /// Sets the `no_kv_events` rule (`None` turns it off).
    pub fn set_silence_rule(&self, rule: Option<SilenceRule>) {
        *self.silence.lock() = rule;
    }

    /// A worker was registered or changed. `listening`: the service runs its KV-event
    /// listeners. A changed endpoint or block size starts its watch over.
    pub fn worker_registered(&self, record: &WorkerRecord, listening: bool) {
        let worker_id = record.spec.worker_id;
        let endpoint = if listening {
            record
                .spec
                .event_endpoints()
                .into_iter()
                .next()
                .map(|(_, a)| a)
        } else {
            None
        };
        let block_size = record.spec.block_size.unwrap_or(0);
        let mut workers = self.workers.lock();
        let watch = workers.entry(worker_id).or_default();
        if watch.events_endpoint != endpoint {
            watch.events_endpoint = endpoint;
            watch.bookings_since_event = 0;
            watch.first_booking_since_event = None;
            self.clear_locked(
                worker_id,
                watch,
                Reason::NoKvEvents,
                "its KV-event endpoint changed",
            );
        }
        if watch.block_size != block_size {
            watch.block_size = block_size;
            self.clear_locked(
                worker_id,
                watch,
                Reason::BlockSizeMismatch,
                "it registered another block size",
            );
        }
    }

    /// A worker was deleted: its reasons and gauge series go.
    pub fn worker_deleted(&self, worker_id: u64) {
        let removed = self.workers.lock().remove(&worker_id);
        let worker = worker_id.to_string();
        for reason in Reason::ALL {
            self.gauge.remove(&DegradedLabels {
                worker: worker.clone(),
                reason: reason.as_str(),
            });
        }
        if let Some(watch) = removed
            && !watch.reasons.is_empty()
        {
            tracing::info!(
                worker_id,
                "worker deleted: its routing degradations are cleared"
            );
        }
    }

    /// A booking went to `worker_id` at `now`.
    pub fn booked(&self, worker_id: u64, now: Instant) {
        let mut workers = self.workers.lock();
        let Some(watch) = workers.get_mut(&worker_id) else {
            return;
        };
        if watch.events_endpoint.is_none() {
            return;
        }
        watch.bookings_since_event += 1;
        watch.first_booking_since_event.get_or_insert(now);
    }

    /// A KV-event message of `worker_id` arrived (decoded, whatever it held).
    pub fn events_arrived(&self, worker_id: u64) {
        let mut workers = self.workers.lock();
        let Some(watch) = workers.get_mut(&worker_id) else {
            return;
        };
        watch.bookings_since_event = 0;
        watch.first_booking_since_event = None;
        self.clear_locked(worker_id, watch, Reason::NoKvEvents, "its KV events arrive");
    }

    /// A `BlockStored` of `worker_id` carried blocks of `block_size` tokens; `endpoint` is where
    /// it came from.
    pub fn block_size_seen(&self, worker_id: u64, block_size: u32, endpoint: &str) {
        let mut workers = self.workers.lock();
        let Some(watch) = workers.get_mut(&worker_id) else {
            return;
        };
        if watch.block_size == 0 {
            return;
        }
        if block_size == watch.block_size {
            self.clear_locked(
                worker_id,
                watch,
                Reason::BlockSizeMismatch,
                "its KV events' blocks are of its registered size",
            );
        } else if !watch.reasons.contains_key(&Reason::BlockSizeMismatch) {
            let message = format!(
                "worker {worker_id}: its KV events ({endpoint}) carry blocks of {block_size} \
                 tokens but it registered block_size {registered}: no prompt can match its cache; \
                 register it with block_size {block_size} (or start the engine with \
                 --block-size {registered})",
                registered = watch.block_size
            );
            self.raise_locked(worker_id, watch, Reason::BlockSizeMismatch, message);
        }
    }

    /// Raises (`Some(message)`) or clears (`None`) a reason another part of the router found
    /// (the gateway's `tokenizer_mismatch` and `cache_mismatch`). An unknown worker is ignored.
    pub fn set(&self, worker_id: u64, reason: Reason, message: Option<String>) {
        let mut workers = self.workers.lock();
        let Some(watch) = workers.get_mut(&worker_id) else {
            return;
        };
        match message {
            Some(message) => {
                if !watch.reasons.contains_key(&reason) {
                    self.raise_locked(worker_id, watch, reason, message);
                }
            }
            None => self.clear_locked(worker_id, watch, reason, "its answers agree again"),
        }
    }

    /// The housekeeping pass: raises `no_kv_events` for workers silent past the rule.
    pub fn check(&self, now: Instant) {
        let Some(rule) = *self.silence.lock() else {
            return;
        };
        let mut workers = self.workers.lock();
        for (&worker_id, watch) in workers.iter_mut() {
            let (Some(endpoint), Some(first)) =
                (&watch.events_endpoint, watch.first_booking_since_event)
            else {
                continue;
            };
            let silent_for = now.saturating_duration_since(first);
            if watch.bookings_since_event >= rule.bookings
                && silent_for >= rule.window
                && !watch.reasons.contains_key(&Reason::NoKvEvents)
            {
                let message = format!(
                    "worker {worker_id}: {n} bookings in {secs} s and no KV event: check the \
                     engine's --kv-events-config endpoint matches kv_events_endpoint {endpoint} \
                     (and that it runs with prefix caching and KV events enabled)",
                    n = watch.bookings_since_event,
                    secs = silent_for.as_secs(),
                );
                self.raise_locked(worker_id, watch, Reason::NoKvEvents, message);
            }
        }
    }

    /// The reasons of `worker_id` now, in [`Reason`] order.
    pub fn of(&self, worker_id: u64) -> Vec<Degraded> {
        self.workers
            .lock()
            .get(&worker_id)
            .map(|w| degraded_list(&w.reasons))
            .unwrap_or_default()
    }

    /// Every degraded worker's reasons.
    pub fn snapshot(&self) -> BTreeMap<u64, Vec<Degraded>> {
        self.workers
            .lock()
            .iter()
            .filter(|(_, w)| !w.reasons.is_empty())
            .map(|(&id, w)| (id, degraded_list(&w.reasons)))
            .collect()
    }

    fn raise_locked(&self, worker_id: u64, watch: &mut Watch, reason: Reason, message: String) {
        tracing::warn!(
            worker_id,
            reason = reason.as_str(),
            "routing degraded: {message}"
        );
        self.gauge
            .get_or_create(&DegradedLabels {
                worker: worker_id.to_string(),
                reason: reason.as_str(),
            })
            .set(1);
        watch.reasons.insert(reason, message);
    }

    fn clear_locked(&self, worker_id: u64, watch: &mut Watch, reason: Reason, because: &str) {
        if watch.reasons.remove(&reason).is_none() {
            return;
        }
        tracing::info!(
            worker_id,
            reason = reason.as_str(),
            "routing no longer degraded: {because}"
        );
        self.gauge
            .get_or_create(&DegradedLabels {
                worker: worker_id.to_string(),
                reason: reason.as_str(),
            })
            .set(0);
    }
}

fn degraded_list(reasons: &BTreeMap<Reason, String>) -> Vec<Degraded> {
    reasons
        .iter()
        .map(|(&reason, message)| Degraded {
            reason,
            message: message.clone(),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvroute_core::selector::{Lifecycle, WorkerSpec};

    fn record(worker_id: u64, events: Option<&str>, block_size: u32) -> WorkerRecord {
        WorkerRecord {
            spec: WorkerSpec {
                worker_id,
                block_size: Some(block_size),
                kv_events_endpoint: events.map(str::to_string),
                ..WorkerSpec::default()
            },
            lifecycle: Lifecycle::Schedulable,
            not_schedulable_reasons: Vec::new(),
        }
    }

    fn gauge(d: &Degradation, worker: u64, reason: Reason) -> Option<i64> {
        let labels = DegradedLabels {
            worker: worker.to_string(),
            reason: reason.as_str(),
        };
        let mut value = None;
        // `get_or_create` would create the series; read it only if it exists.
        let text = {
            let mut registry = prometheus_client::registry::Registry::default();
            registry.register("g", "", d.gauge());
            let mut out = String::new();
            prometheus_client::encoding::text::encode(&mut out, &registry).unwrap();
            out
        };
        let needle = format!(
            "g{{worker=\"{}\",reason=\"{}\"}} ",
            labels.worker, labels.reason
        );
        for line in text.lines() {
            if let Some(v) = line.strip_prefix(&needle) {
                value = v.parse().ok();
            }
        }
        value
    }

    #[test]
    fn silence_is_raised_past_both_bounds_and_cleared_by_an_event() {
        let d = Degradation::new();
        d.set_silence_rule(Some(SilenceRule {
            window: Duration::from_secs(30),
            bookings: 3,
        }));
        d.worker_registered(&record(1, Some("tcp://127.0.0.1:5557"), 16), true);
        d.worker_registered(&record(2, None, 16), true);
        let t0 = Instant::now();
        for i in 0..5 {
            d.booked(1, t0 + Duration::from_secs(i));
            d.booked(2, t0 + Duration::from_secs(i));
        }
        // Enough bookings, not yet long enough.
        d.check(t0 + Duration::from_secs(29));
        assert!(d.of(1).is_empty());
        d.check(t0 + Duration::from_secs(31));
        let reasons = d.of(1);
        assert_eq!(reasons.len(), 1);
        assert_eq!(reasons[0].reason, Reason::NoKvEvents);
        assert!(
            reasons[0].message.contains("5 bookings in 31 s")
                && reasons[0].message.contains("tcp://127.0.0.1:5557"),
            "{}",
            reasons[0].message
        );
        assert_eq!(gauge(&d, 1, Reason::NoKvEvents), Some(1));
        // A worker without an events endpoint is never silent.
        assert!(d.of(2).is_empty());
        d.events_arrived(1);
        assert!(d.of(1).is_empty());
        assert_eq!(gauge(&d, 1, Reason::NoKvEvents), Some(0));
        // Long enough, too few bookings since the event.
        d.booked(1, t0 + Duration::from_secs(40));
        d.check(t0 + Duration::from_secs(100));
        assert!(d.of(1).is_empty());
        // Not listening (--no-kv-events): not watched.
        d.worker_registered(&record(1, Some("tcp://127.0.0.1:5557"), 16), false);
        for i in 0..5 {
            d.booked(1, t0 + Duration::from_secs(100 + i));
        }
        d.check(t0 + Duration::from_secs(200));
        assert!(d.of(1).is_empty());
    }

    #[test]
    fn block_sizes_raise_and_clear_and_a_reregistration_starts_over() {
        let d = Degradation::new();
        d.worker_registered(&record(7, Some("tcp://e:1"), 16), true);
        d.block_size_seen(7, 16, "tcp://e:1");
        assert!(d.of(7).is_empty());
        d.block_size_seen(7, 32, "tcp://e:1");
        let reasons = d.of(7);
        assert_eq!(reasons[0].reason, Reason::BlockSizeMismatch);
        assert!(reasons[0].message.contains("blocks of 32 tokens"));
        assert!(reasons[0].message.contains("registered block_size 16"));
        d.block_size_seen(7, 16, "tcp://e:1");
        assert!(d.of(7).is_empty());
        d.block_size_seen(7, 32, "tcp://e:1");
        d.worker_registered(&record(7, Some("tcp://e:1"), 32), true);
        assert!(d.of(7).is_empty(), "re-registered with the engine's size");
        d.block_size_seen(7, 32, "tcp://e:1");
        assert!(d.of(7).is_empty());
        d.set(
            7,
            Reason::TokenizerMismatch,
            Some("worker 7: tokens".into()),
        );
        assert_eq!(d.snapshot()[&7][0].reason, Reason::TokenizerMismatch);
        d.worker_deleted(7);
        assert!(d.snapshot().is_empty());
        assert_eq!(gauge(&d, 7, Reason::TokenizerMismatch), None);
        // Unknown workers are ignored.
        d.set(8, Reason::CacheMismatch, Some("x".into()));
        assert!(d.snapshot().is_empty());
    }
}
