//! Prometheus metrics (SPEC §12), one registry per service instance (no globals), all named
//! `kvroute_*`. Per-rank load, pending-cache and index sizes are refreshed from the selector when
//! `/metrics` is scraped; counters of events are incremented as they happen.
//!
//! Decision quality: every successful `/select` and `/select_and_reserve` adds the
//! chosen rank's device overlap (`kind="chosen"`) and the largest device overlap among its
//! candidate ranks (`kind="best"`, see `Selection::best_gpu_overlap`) to
//! `kvroute_selection_overlap_tokens_total` per partition, and observes `best − chosen` in blocks
//! in `kvroute_selection_overlap_gap_blocks`. `chosen ÷ best` is the decision quality (1 when the
//! selector always took the largest cache on offer). Advisory selects count too: `advisory` only
//! adds `worker_load` to the answer, the decision is the same one. Failed selections count nothing.

use kvroute_core::index::ApplyOutcome;
use kvroute_core::pending::PendingCounters;
use kvroute_core::selector::{PredictionCounters, Selection, Selector, SessionCounters};
use parking_lot::Mutex;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::encoding::text::{encode_eof, encode_registry};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

mod queue;
mod sync;

pub use queue::QueueMetrics;
pub use sync::SyncMetrics;

pub type Labels = Vec<(String, String)>;

fn labels(pairs: &[(&str, &str)]) -> Labels {
    pairs
        .iter()
        .map(|(k, v)| ((*k).to_string(), (*v).to_string()))
        .collect()
}

/// Labels of the per-request counter. Static strings and a number, so counting a request
/// allocates nothing.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct HttpLabels {
    route: &'static str,
    method: &'static str,
    status: u16,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RouteLabel {
    route: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PhaseLabel {
    phase: &'static str,
}

/// Labels of the decision-quality counters.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct OverlapLabels {
    model_name: String,
    routing_group: String,
    kind: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PartitionLabels {
    model_name: String,
    routing_group: String,
}

/// Blocks of cache the selector left on the table: 0, 1, 2, 4, …, 1024, +Inf.
fn gap_histogram() -> Histogram {
    Histogram::new(std::iter::once(0.0).chain(exponential_buckets(1.0, 2.0, 11)))
}

/// How a predicted block's prediction ended (`kvroute_predicted_blocks_total`).
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PredictionLabel {
    outcome: &'static str,
}

const PREDICTION_OUTCOMES: [&str; 3] = ["confirmed", "expired", "withdrawn"];

fn latency_histogram() -> Histogram {
    // 20 µs … ~10 s.
    Histogram::new(exponential_buckets(20e-6, 2.0, 20))
}

/// Why a poll of an engine's `/metrics` gave no load
/// (`kvroute_engine_metrics_poll_errors_total`).
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ReasonLabel {
    reason: &'static str,
}

/// Why the service closed a connection on its own (`kvroute_http_connection_timeouts_total`).
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct TimeoutLabel {
    phase: &'static str,
}

/// The HTTP connections' counters, shared with the listener and each connection (clones of
/// one set of atomics).
#[derive(Debug, Clone, Default)]
pub struct ConnectionMetrics {
    /// Connections open now.
    pub open: Gauge,
    /// Connections closed at accept because `--max-connections` were open.
    pub refused: Counter,
    /// Connections closed because a request's head did not arrive in time.
    pub header_timeouts: Counter,
    /// Kept-alive connections closed after `--idle-timeout-secs` without activity.
    pub idle_timeouts: Counter,
}

#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    http_requests: Family<HttpLabels, Counter>,
    /// The HTTP connections: open, refused, timed out.
    pub connections: ConnectionMetrics,
    http_duration: Family<RouteLabel, Histogram, fn() -> Histogram>,
    select_phase: Family<PhaseLabel, Histogram, fn() -> Histogram>,
    selection_overlap: Family<OverlapLabels, Counter>,
    selection_gap: Family<PartitionLabels, Histogram, fn() -> Histogram>,
    kv_events: Family<Labels, Counter>,
    /// ZMQ messages per endpoint and status (ok, malformed, duplicate, replayed, stale).
    pub kv_messages: Family<Labels, Counter>,
    /// Sequence gaps detected per endpoint.
    pub kv_gaps: Family<Labels, Counter>,
    /// Engine restarts detected (sequence went backwards) per endpoint.
    pub kv_restarts: Family<Labels, Counter>,
    /// Listener state per endpoint: 0 connecting, 1 live, 2 replaying, 3 stopped.
    pub kv_listener_state: Family<Labels, Gauge>,
    /// Decoded KV-event batches queued for the applier and not yet taken by it: the service's
    /// measure of KV-event lag (0 when the index has taken everything the listeners received).
    pub kv_apply_queue: Gauge,
    expired_reservations: Counter,
    rank_prefill_tokens: Family<Labels, Gauge>,
    rank_decode_blocks: Family<Labels, Gauge>,
    rank_requests: Family<Labels, Gauge>,
    pending_entries: Gauge,
    pending_bytes: Gauge,
    pending_evictions: Family<Labels, Counter>,
    index_blocks: Family<Labels, Gauge>,
    index_pairs: Family<Labels, Gauge>,
    pending_seen: Mutex<PendingCounters>,
    approx_blocks: Family<Labels, Gauge>,
    approx_lru: Family<Labels, Counter>,
    approx_seen: Mutex<kvroute_core::approx::LruCounters>,
    predicted_blocks: Family<PredictionLabel, Counter>,
    predicted_seen: Mutex<PredictionCounters>,
    session_bindings: Gauge,
    session_events: Family<Labels, Counter>,
    session_seen: Mutex<SessionCounters>,
    /// Polls of engines' `/metrics` (`engine_load`): reports taken, and failures by reason.
    engine_polls: Counter,
    engine_poll_errors: Family<ReasonLabel, Counter>,
    /// Replica sync over NATS (`kvroute_sync_*`).
    pub sync: SyncMetrics,
    /// The workers whose routing is degraded (`kvroute_routing_degraded`), with what to fix:
    /// kept here because the listeners, the bookings and the gateway all report into it and
    /// all already hold the metrics.
    pub degraded: crate::degraded::Degradation,
    /// The admission queue (`kvroute_queue_*`).
    pub queue: QueueMetrics,
    /// Registries of other crates serving on the service's port (the gateway's), rendered after
    /// the service's own ([`Metrics::attach`]).
    attached: Mutex<Vec<Registry>>,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    pub fn new() -> Self {
        let mut registry = Registry::with_prefix("kvroute");
        let http_requests = Family::<HttpLabels, Counter>::default();
        registry.register(
            "http_requests",
            "HTTP requests by route, method and status",
            http_requests.clone(),
        );
        let http_duration =
            Family::<RouteLabel, Histogram, fn() -> Histogram>::new_with_constructor(
                latency_histogram,
            );
        registry.register(
            "http_request_duration_seconds",
            "HTTP request latency by route",
            http_duration.clone(),
        );
        // The family's two counters are shared with the connections, which count without a
        // label lookup.
        let connection_timeouts = Family::<TimeoutLabel, Counter>::default();
        let timeouts = |phase| {
            connection_timeouts
                .get_or_create(&TimeoutLabel { phase })
                .clone()
        };
        let connections = ConnectionMetrics {
            open: Gauge::default(),
            refused: Counter::default(),
            header_timeouts: timeouts("header"),
            idle_timeouts: timeouts("idle"),
        };
        registry.register(
            "http_connections_open",
            "Open HTTP connections",
            connections.open.clone(),
        );
        registry.register(
            "http_connections_refused",
            "HTTP connections closed at accept because --max-connections were open",
            connections.refused.clone(),
        );
        registry.register(
            "http_connection_timeouts",
            "HTTP connections closed by the service: a request head not received within --header-read-timeout-ms (phase=header), or no activity for --idle-timeout-secs (phase=idle)",
            connection_timeouts.clone(),
        );
        let select_phase = Family::<PhaseLabel, Histogram, fn() -> Histogram>::new_with_constructor(
            latency_histogram,
        );
        registry.register(
            "select_phase_duration_seconds",
            "Selection overhead by phase (hash: hashing token ids; route: index lookup and scheduling)",
            select_phase.clone(),
        );
        let selection_overlap = Family::<OverlapLabels, Counter>::default();
        registry.register(
            "selection_overlap_tokens",
            "Device overlap tokens of the chosen rank (kind=chosen) and the best candidate rank (kind=best) per selection; chosen/best is the decision quality",
            selection_overlap.clone(),
        );
        let selection_gap =
            Family::<PartitionLabels, Histogram, fn() -> Histogram>::new_with_constructor(
                gap_histogram,
            );
        registry.register(
            "selection_overlap_gap_blocks",
            "Per selection, the best candidate rank's device overlap minus the chosen rank's, in blocks",
            selection_gap.clone(),
        );
        let kv_events = Family::<Labels, Counter>::default();
        registry.register(
            "kv_events",
            "KV events (blocks for stored/removed) by type and status",
            kv_events.clone(),
        );
        let kv_messages = Family::<Labels, Counter>::default();
        registry.register(
            "kv_messages",
            "KV-event messages by endpoint and status",
            kv_messages.clone(),
        );
        let kv_gaps = Family::<Labels, Counter>::default();
        registry.register(
            "kv_sequence_gaps",
            "Sequence gaps detected per endpoint",
            kv_gaps.clone(),
        );
        let kv_restarts = Family::<Labels, Counter>::default();
        registry.register(
            "kv_engine_restarts",
            "Engine restarts detected per endpoint (sequence went backwards)",
            kv_restarts.clone(),
        );
        let kv_listener_state = Family::<Labels, Gauge>::default();
        registry.register(
            "kv_listener_state",
            "Listener state per endpoint: 0 connecting, 1 live, 2 replaying, 3 stopped",
            kv_listener_state.clone(),
        );
        let kv_apply_queue = Gauge::default();
        registry.register(
            "kv_apply_queue_batches",
            "Decoded KV-event batches waiting for the applier (the KV-event lag: 0 when the index is caught up with what the listeners received)",
            kv_apply_queue.clone(),
        );
        let expired_reservations = Counter::default();
        registry.register(
            "expired_reservations",
            "Reservations freed because no lifecycle call came within the expiry",
            expired_reservations.clone(),
        );
        let rank_prefill_tokens = Family::<Labels, Gauge>::default();
        registry.register(
            "rank_active_prefill_tokens",
            "Active prefill tokens per rank",
            rank_prefill_tokens.clone(),
        );
        let rank_decode_blocks = Family::<Labels, Gauge>::default();
        registry.register(
            "rank_active_decode_blocks",
            "Active decode blocks per rank",
            rank_decode_blocks.clone(),
        );
        let rank_requests = Family::<Labels, Gauge>::default();
        registry.register(
            "rank_active_requests",
            "Active requests per rank",
            rank_requests.clone(),
        );
        let pending_entries = Gauge::default();
        registry.register(
            "pending_selections",
            "Entries in the pending-selection cache",
            pending_entries.clone(),
        );
        let pending_bytes = Gauge::default();
        registry.register(
            "pending_selection_bytes",
            "Approximate bytes of the pending-selection cache",
            pending_bytes.clone(),
        );
        let pending_evictions = Family::<Labels, Counter>::default();
        registry.register(
            "pending_selection_evictions",
            "Pending selections evicted, by cause (expired, entries, bytes)",
            pending_evictions.clone(),
        );
        let index_blocks = Family::<Labels, Gauge>::default();
        registry.register(
            "index_blocks",
            "Distinct indexed blocks per partition",
            index_blocks.clone(),
        );
        let index_pairs = Family::<Labels, Gauge>::default();
        registry.register(
            "index_block_rank_pairs",
            "Indexed (block, rank) pairs per partition",
            index_pairs.clone(),
        );
        let approx_blocks = Family::<Labels, Gauge>::default();
        registry.register(
            "approx_rank_blocks",
            "Approximate cache model per rank: predicted (ttl) or resident/active/inactive/overcapacity (lru) blocks",
            approx_blocks.clone(),
        );
        let approx_lru = Family::<Labels, Counter>::default();
        registry.register(
            "approx_lru",
            "LRU model events: evicted blocks, reaped leases, overcapacity allocations, retired leases",
            approx_lru.clone(),
        );
        let predicted_blocks = Family::<PredictionLabel, Counter>::default();
        registry.register(
            "predicted_blocks",
            "Blocks predicted on route, by how their prediction ended: confirmed by the rank's own Stored, expired (TTL or cap), withdrawn (other events of the rank naming them, a restart, the worker's removal)",
            predicted_blocks.clone(),
        );
        for outcome in PREDICTION_OUTCOMES {
            predicted_blocks
                .get_or_create(&PredictionLabel { outcome })
                .inc_by(0);
        }
        let session_bindings = Gauge::default();
        registry.register(
            "session_bindings",
            "Session affinity: live bindings of sessions to ranks (expired ones until the next tick)",
            session_bindings.clone(),
        );
        let session_events = Family::<Labels, Counter>::default();
        registry.register(
            "session_bindings_events",
            "Session bindings made (bound), moved to another rank (rebound), expired, evicted by --session-affinity-max-sessions, dropped by a refused booking",
            session_events.clone(),
        );
        let engine_polls = Counter::default();
        registry.register(
            "engine_metrics_polls",
            "Polls of engines' /metrics (--engine-metrics-poll-ms) that reported a load",
            engine_polls.clone(),
        );
        let engine_poll_errors = Family::<ReasonLabel, Counter>::default();
        registry.register(
            "engine_metrics_poll_errors",
            "Polls of engines' /metrics that reported no load, by reason: bad_url, connect, timeout, status, body, parse, no_load_metrics, rejected",
            engine_poll_errors.clone(),
        );
        let sync = SyncMetrics::register(&mut registry);
        let queue = QueueMetrics::register(&mut registry);
        let degraded = crate::degraded::Degradation::new();
        registry.register(
            "routing_degraded",
            "1 while a worker's routing is degraded for the reason (no_kv_events, block_size_mismatch, tokenizer_mismatch, cache_mismatch), 0 once cleared; GET /loads says what to fix",
            degraded.gauge(),
        );
        Self {
            degraded,
            engine_polls,
            engine_poll_errors,
            queue,
            session_bindings,
            session_events,
            session_seen: Mutex::new(SessionCounters::default()),
            registry,
            sync,
            attached: Mutex::new(Vec::new()),
            http_requests,
            connections,
            http_duration,
            select_phase,
            selection_overlap,
            selection_gap,
            kv_events,
            kv_messages,
            kv_gaps,
            kv_restarts,
            kv_listener_state,
            kv_apply_queue,
            expired_reservations,
            rank_prefill_tokens,
            rank_decode_blocks,
            rank_requests,
            pending_entries,
            pending_bytes,
            pending_evictions,
            index_blocks,
            index_pairs,
            pending_seen: Mutex::new(PendingCounters::default()),
            approx_blocks,
            approx_lru,
            approx_seen: Mutex::new(Default::default()),
            predicted_blocks,
            predicted_seen: Mutex::new(PredictionCounters::default()),
        }
    }

    /// Counts one request of a route (its template, e.g. `/reservations/{reservation_id}`).
    pub fn observe_http(
        &self,
        route: &'static str,
        method: &'static str,
        status: u16,
        seconds: f64,
    ) {
        self.http_requests
            .get_or_create(&HttpLabels {
                route,
                method,
                status,
            })
            .inc();
        self.http_duration
            .get_or_create(&RouteLabel { route })
            .observe(seconds);
    }

    pub fn observe_phase(&self, phase: &'static str, seconds: f64) {
        self.select_phase
            .get_or_create(&PhaseLabel { phase })
            .observe(seconds);
    }

    /// Counts a successful selection's chosen and best device overlap (module doc).
    pub fn observe_selection(&self, selection: &Selection) {
        let Selection {
            partition,
            overlap,
            best_gpu_overlap,
            block_size,
            ..
        } = selection;
        let chosen = overlap.gpu;
        let best = (*best_gpu_overlap).max(chosen);
        let mut l = OverlapLabels {
            model_name: partition.model_name.clone(),
            routing_group: partition.routing_group.clone(),
            kind: "chosen",
        };
        self.selection_overlap.get_or_create(&l).inc_by(chosen);
        l.kind = "best";
        self.selection_overlap.get_or_create(&l).inc_by(best);
        let gap_blocks = (best - chosen) / u64::from((*block_size).max(1));
        self.selection_gap
            .get_or_create(&PartitionLabels {
                model_name: l.model_name,
                routing_group: l.routing_group,
            })
            .observe(gap_blocks as f64);
    }

    pub fn count_events(&self, outcome: &ApplyOutcome) {
        let add = |kind: &str, status: &str, n: u64| {
            if n > 0 {
                self.kv_events
                    .get_or_create(&labels(&[("type", kind), ("status", status)]))
                    .inc_by(n);
            }
        };
        add("stored", "applied", outcome.stored_blocks);
        add(
            "stored",
            "parent_block_not_found",
            outcome.parent_block_not_found,
        );
        add(
            "stored",
            "engine_hash_conflict",
            outcome.engine_hash_conflicts,
        );
        add("stored", "evicted_by_cap", outcome.evicted_blocks);
        add(
            "stored",
            "rank_capacity_exceeded",
            outcome.rank_capacity_exceeded,
        );
        add("removed", "applied", outcome.removed_blocks);
        add("removed", "unknown_block", outcome.unknown_removed_blocks);
        add("cleared", "applied", outcome.cleared_ranks);
    }

    /// Counts events that never reached the index (unknown worker, ignored group, bad medium).
    pub fn count_dropped_events(&self, kind: &str, status: &str, n: u64) {
        if n > 0 {
            self.kv_events
                .get_or_create(&labels(&[("type", kind), ("status", status)]))
                .inc_by(n);
        }
    }

    pub fn endpoint_labels(worker_id: u64, dp_rank: u32, endpoint: &str) -> Labels {
        labels(&[
            ("worker_id", &worker_id.to_string()),
            ("dp_rank", &dp_rank.to_string()),
            ("endpoint", endpoint),
        ])
    }

    /// One poll of an engine's `/metrics`: a report, or the reason there was none.
    pub fn count_engine_poll(&self, outcome: Result<(), &'static str>) {
        match outcome {
            Ok(()) => self.engine_polls.inc(),
            Err(reason) => self
                .engine_poll_errors
                .get_or_create(&ReasonLabel { reason })
                .inc(),
        };
    }

    /// Polls of engines' `/metrics` that reported a load.
    pub fn engine_polls(&self) -> u64 {
        self.engine_polls.get()
    }

    /// Polls of engines' `/metrics` that failed for `reason`.
    pub fn engine_poll_errors(&self, reason: &'static str) -> u64 {
        self.engine_poll_errors
            .get_or_create(&ReasonLabel { reason })
            .get()
    }

    pub fn count_expired(&self, n: usize) {
        self.expired_reservations.inc_by(n as u64);
    }

    /// Refreshes the gauges that mirror selector state, then renders the text exposition.
    pub fn render(&self, selector: &Selector) -> String {
        self.rank_prefill_tokens.clear();
        self.rank_decode_blocks.clear();
        self.rank_requests.clear();
        self.approx_blocks.clear();
        for partition in selector.loads(None, None) {
            for load in &partition.loads {
                let worker = load.worker_id.to_string();
                let rank = load.dp_rank.to_string();
                let l = labels(&[
                    ("model_name", &partition.partition.model_name),
                    ("routing_group", &partition.partition.routing_group),
                    ("worker_id", &worker),
                    ("dp_rank", &rank),
                ]);
                let set = |policy: &str, state: &str, v: u64| {
                    self.approx_blocks
                        .get_or_create(&labels(&[
                            ("worker_id", &worker),
                            ("dp_rank", &rank),
                            ("policy", policy),
                            ("state", state),
                        ]))
                        .set(v as i64);
                };
                match load.cache_model {
                    Some(kvroute_core::selector::CacheModelReport::Ttl { blocks }) => {
                        set("ttl", "predicted", blocks)
                    }
                    Some(kvroute_core::selector::CacheModelReport::Lru(s)) => {
                        set("lru", "resident", s.resident_blocks);
                        set("lru", "active", s.active_blocks);
                        set("lru", "inactive", s.inactive_blocks);
                        set("lru", "overcapacity", s.overcapacity_blocks);
                    }
                    _ => {}
                }
                self.rank_prefill_tokens
                    .get_or_create(&l)
                    .set(load.potential_prefill_tokens as i64);
                self.rank_decode_blocks
                    .get_or_create(&l)
                    .set(load.potential_decode_blocks as i64);
                self.rank_requests
                    .get_or_create(&l)
                    .set(load.active_requests as i64);
            }
        }
        self.index_blocks.clear();
        self.index_pairs.clear();
        for (partition, blocks, pairs) in selector.index_sizes() {
            let l = labels(&[
                ("model_name", &partition.model_name),
                ("routing_group", &partition.routing_group),
            ]);
            self.index_blocks.get_or_create(&l).set(blocks as i64);
            self.index_pairs.get_or_create(&l).set(pairs as i64);
        }
        let (entries, bytes) = selector.pending_stats();
        self.pending_entries.set(entries as i64);
        self.pending_bytes.set(bytes as i64);
        let now = selector.pending_counters();
        {
            let mut seen = self.pending_seen.lock();
            for (cause, current, previous) in [
                ("expired", now.evicted_expired, seen.evicted_expired),
                ("entries", now.evicted_for_entries, seen.evicted_for_entries),
                ("bytes", now.evicted_for_bytes, seen.evicted_for_bytes),
            ] {
                self.pending_evictions
                    .get_or_create(&labels(&[("cause", cause)]))
                    .inc_by(current.saturating_sub(previous));
            }
            *seen = now;
        }
        let lru = selector.lru_counters();
        {
            let mut seen = self.approx_seen.lock();
            for (event, current, previous) in [
                ("evicted_blocks", lru.evicted_blocks, seen.evicted_blocks),
                ("reaped_leases", lru.reaped_leases, seen.reaped_leases),
                (
                    "overcapacity_allocations",
                    lru.overcapacity_allocations,
                    seen.overcapacity_allocations,
                ),
                ("retired_leases", lru.retired_leases, seen.retired_leases),
            ] {
                self.approx_lru
                    .get_or_create(&labels(&[("event", event)]))
                    .inc_by(current.saturating_sub(previous));
            }
            *seen = lru;
        }
        let predicted = selector.prediction_counters();
        {
            let mut seen = self.predicted_seen.lock();
            for (outcome, current, previous) in [
                ("confirmed", predicted.confirmed, seen.confirmed),
                ("expired", predicted.expired, seen.expired),
                ("withdrawn", predicted.withdrawn, seen.withdrawn),
            ] {
                self.predicted_blocks
                    .get_or_create(&PredictionLabel { outcome })
                    .inc_by(current.saturating_sub(previous));
            }
            *seen = predicted;
        }
        let (bindings, sessions) = selector.session_stats();
        self.session_bindings.set(bindings as i64);
        {
            let mut seen = self.session_seen.lock();
            for (event, current, previous) in [
                ("bound", sessions.bound, seen.bound),
                ("rebound", sessions.rebound, seen.rebound),
                ("expired", sessions.expired, seen.expired),
                ("evicted", sessions.evicted, seen.evicted),
                ("dropped", sessions.dropped, seen.dropped),
            ] {
                self.session_events
                    .get_or_create(&labels(&[("event", event)]))
                    .inc_by(current.saturating_sub(previous));
            }
            *seen = sessions;
        }
        let mut out = String::new();
        // Writing into a String cannot fail.
        let _ = encode_registry(&mut out, &self.registry);
        for registry in self.attached.lock().iter() {
            let _ = encode_registry(&mut out, registry);
        }
        let _ = encode_eof(&mut out);
        out
    }

    /// Adds another crate's metrics to `GET /metrics` (their names should carry a prefix of
    /// their own, such as `kvroute_gateway`).
    pub fn attach(&self, registry: Registry) {
        self.attached.lock().push(registry);
    }
}
