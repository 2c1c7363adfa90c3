//! The workload of `kvroute bench index`: a Mooncake trace turned into the KV events and lookups
//! a fleet of engines would send one router, on one timeline, ready to replay against the index.
//!
//! ## How the schedule is built
//! 1. The trace's requests get sessions ([`sessions_by_opening`] when the trace has none), and
//!    each session goes to one of `workers` engines, at random from `seed`.
//! 2. Each engine runs its requests through the simulator's [`Engine`] (prefix caching, LRU
//!    eviction, chunked prefill) in virtual time at the trace's own pace. Every step's KV events
//!    (`Stored` and `Removed`) become one batch at the step's end, as an engine publishes one
//!    message a step; each request is one lookup of its prompt at its arrival.
//! 3. The engines' timelines are merged and rescaled so that the span from the first operation
//!    to the last is `window_nanos / rate_scale`.
//! 4. The fleet is duplicated `duplication` times: copy `r` of engine `w` is worker
//!    `w + r × workers`, with the same hashes at the same deadlines (as if `r × workers` more
//!    engines replayed the same conversations).
//! 5. Operations are sorted stably by deadline, lookups before events at equal deadlines, then
//!    by worker and by their order on their engine.
//!
//! With `spread_ms` (0: off), arrivals the trace records at one instant are spread over the
//! trace's resolution instead: each request's timestamp moves later by a uniform draw in
//! `[0, spread_ms)` before step 1, the requests of one recorded instant keeping their order (the
//! Mooncake traces record whole seconds, so a second's requests would otherwise arrive at the
//! same nanosecond), and each worker of step 4 (copies
//! included) shifts its whole timeline later by its own draw in the same range, scaled as in
//! step 3 (copies of one engine would not run in lockstep). Seeded like the rest.
//!
//! Pure and deterministic: the same trace, options and seed give the same schedule.

use crate::engine::{Engine, EngineConfig};
use crate::workload::{ArrivalOptions, MooncakeRow, mooncake_workload, sessions_by_opening};
use crate::{RequestId, SimError, SimRequest};
use hashbrown::HashMap;
use kvroute_core::event::KvEvent;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

/// What to build.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct IndexBenchSpec {
    /// Distinct engines the trace is spread over (`N`).
    pub workers: usize,
    /// Copies of the fleet (`d`): `workers × duplication` workers in all.
    pub duplication: usize,
    /// The replay window before `rate_scale`.
    pub window_nanos: u64,
    /// Offered-rate multiplier: the schedule spans `window_nanos / rate_scale`.
    pub rate_scale: f64,
    pub seed: u64,
    /// The engines' model: block size, pool size (`kv_blocks`), batching.
    pub engine: EngineConfig,
    /// Keep only the first N requests of the trace.
    pub max_requests: Option<usize>,
    /// Spread of arrivals and worker timelines over the trace's resolution, in trace
    /// milliseconds (module documentation); 0 replays the timestamps as recorded.
    pub spread_ms: f64,
}

impl IndexBenchSpec {
    /// Checks every knob, naming it in the message.
    pub fn validate(&self) -> Result<(), SimError> {
        if self.workers == 0 {
            return Err(SimError::invalid("workers", "must be greater than 0"));
        }
        if self.duplication == 0 {
            return Err(SimError::invalid("duplication", "must be greater than 0"));
        }
        if (self.workers as u128) * (self.duplication as u128) > u128::from(u32::MAX) {
            return Err(SimError::invalid(
                "duplication",
                "workers × duplication must be below 2^32",
            ));
        }
        if self.window_nanos == 0 {
            return Err(SimError::invalid("window-secs", "must be greater than 0"));
        }
        if !(self.rate_scale.is_finite() && self.rate_scale > 0.0) {
            return Err(SimError::invalid(
                "rate-scale",
                format!("must be a positive number, got {}", self.rate_scale),
            ));
        }
        if !(self.spread_ms.is_finite() && self.spread_ms >= 0.0) {
            return Err(SimError::invalid(
                "spread-ms",
                format!("must be a number at least 0, got {}", self.spread_ms),
            ));
        }
        self.engine.validate()
    }
}

/// One operation of the schedule.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OpKind {
    /// A lookup of the prompt `IndexSchedule::prompts[prompt]`.
    Lookup { prompt: u32 },
    /// The KV-event batch `IndexSchedule::batches[batch]`, from the op's worker.
    Events { batch: u32 },
}

/// An operation at its deadline.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ScheduledOp {
    /// Nanoseconds from the start of the replay.
    pub deadline_nanos: u64,
    pub worker_id: u64,
    pub kind: OpKind,
}

/// What the schedule holds, for the denominators of the report.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct OpCounts {
    pub lookups: u64,
    pub stored_events: u64,
    pub removed_events: u64,
    pub cleared_events: u64,
    /// Blocks of all lookups' prompts.
    pub lookup_blocks: u64,
    pub stored_blocks: u64,
    pub removed_blocks: u64,
    /// KV-event batches (one per engine step that changed the cache).
    pub batches: u64,
}

impl OpCounts {
    /// Lookups plus events (`Stored`, `Removed`, `Cleared`): the logical denominator.
    pub fn logical_ops(&self) -> u64 {
        self.lookups + self.stored_events + self.removed_events + self.cleared_events
    }

    /// Blocks of lookups plus blocks of `Stored` and `Removed` events.
    pub fn block_ops(&self) -> u64 {
        self.lookup_blocks + self.stored_blocks + self.removed_blocks
    }

    fn count_batch(&mut self, events: &[KvEvent]) {
        self.batches += 1;
        for event in events {
            match event {
                KvEvent::Stored { blocks, .. } => {
                    self.stored_events += 1;
                    self.stored_blocks += blocks.len() as u64;
                }
                KvEvent::Removed { engine_hashes, .. } => {
                    self.removed_events += 1;
                    self.removed_blocks += engine_hashes.len() as u64;
                }
                KvEvent::Cleared => self.cleared_events += 1,
            }
        }
    }
}

/// The replay: operations in order, and the prompts and batches they name (shared by the copies
/// of the fleet).
#[derive(Debug, Clone, Default)]
pub struct IndexSchedule {
    pub ops: Vec<ScheduledOp>,
    /// Each lookup's prompt as sequence hashes (the engines' block hashes).
    pub prompts: Vec<Vec<u64>>,
    pub batches: Vec<Vec<KvEvent>>,
    pub counts: OpCounts,
    /// Workers in all (`workers × duplication`); their ids are `0..total_workers`.
    pub total_workers: u64,
    /// The span the deadlines are scaled to.
    pub span_nanos: u64,
    /// Requests the engines could not hold at all (larger than the pool), left out.
    pub dropped_requests: u64,
}

/// One engine's timeline: `(virtual time, order on the engine, op)`.
type Timeline = Vec<(u64, u32, OpKind)>;

/// Builds the schedule from a Mooncake trace's rows. See the module documentation.
pub fn build_schedule(
    rows: &[MooncakeRow],
    spec: &IndexBenchSpec,
) -> Result<IndexSchedule, SimError> {
    spec.validate()?;
    let mut rows = rows.to_vec();
    // A separate stream, so that the sessions' assignment does not depend on the spread.
    let mut spread_rng = SmallRng::seed_from_u64(spec.seed ^ 0x5350_5245_4144);
    if spec.spread_ms > 0.0 {
        // The requests of one recorded instant keep their order (a session's turns too): they
        // take that many draws, sorted.
        let mut draws = Vec::new();
        for group in rows.chunk_by_mut(|a, b| a.timestamp == b.timestamp) {
            draws.clear();
            draws.extend((0..group.len()).map(|_| spread_rng.random::<f64>() * spec.spread_ms));
            draws.sort_by(f64::total_cmp);
            for (row, draw) in group.iter_mut().zip(&draws) {
                row.timestamp += draw;
            }
        }
        rows.sort_by(|a, b| a.timestamp.total_cmp(&b.timestamp));
    }
    sessions_by_opening(&mut rows);
    let workload = mooncake_workload(
        "index-bench",
        &rows,
        spec.engine.block_size,
        &ArrivalOptions {
            max_requests: spec.max_requests,
            ..ArrivalOptions::default()
        },
    )?;
    // Sessions to engines, in order of first appearance, so the draw does not depend on hashing.
    let mut rng = SmallRng::seed_from_u64(spec.seed);
    let mut engine_of_session: HashMap<u64, usize> = HashMap::new();
    let mut requests_of: Vec<Vec<SimRequest>> = vec![Vec::new(); spec.workers];
    for request in workload.requests {
        let engine = match request.session_id {
            Some(s) => *engine_of_session
                .entry(s)
                .or_insert_with(|| rng.random_range(0..spec.workers)),
            None => rng.random_range(0..spec.workers),
        };
        requests_of[engine].push(request);
    }

    let mut schedule = IndexSchedule::default();
    let mut timelines: Vec<Timeline> = Vec::with_capacity(spec.workers);
    for requests in &requests_of {
        timelines.push(run_engine(requests, &spec.engine, &mut schedule)?);
    }

    // Rescale the merged timeline to the span.
    let first = timelines
        .iter()
        .filter_map(|t| t.first().map(|e| e.0))
        .min()
        .unwrap_or(0);
    let last = timelines
        .iter()
        .filter_map(|t| t.last().map(|e| e.0))
        .max()
        .unwrap_or(0);
    let span_nanos = (spec.window_nanos as f64 / spec.rate_scale).round() as u64;
    let factor = if last > first {
        span_nanos as f64 / (last - first) as f64
    } else {
        0.0
    };
    let base_counts = schedule.counts;
    // Each worker's shift (module documentation), in schedule nanoseconds.
    let shift_of: Vec<u64> = (0..spec.workers * spec.duplication)
        .map(|_| {
            if spec.spread_ms > 0.0 {
                (spread_rng.random::<f64>() * spec.spread_ms * 1e6 * factor).round() as u64
            } else {
                0
            }
        })
        .collect();
    let mut ops = Vec::new();
    for (engine, timeline) in timelines.iter().enumerate() {
        for &(t, order, kind) in timeline {
            let deadline_nanos = ((t - first) as f64 * factor).round() as u64;
            for r in 0..spec.duplication {
                ops.push((
                    deadline_nanos + shift_of[engine + r * spec.workers],
                    matches!(kind, OpKind::Events { .. }),
                    (engine + r * spec.workers) as u64,
                    order,
                    kind,
                ));
            }
        }
    }
    ops.sort_by_key(|&(deadline, is_event, worker, order, _)| (deadline, is_event, worker, order));
    schedule.ops = ops
        .into_iter()
        .map(|(deadline_nanos, _, worker_id, _, kind)| ScheduledOp {
            deadline_nanos,
            worker_id,
            kind,
        })
        .collect();
    let d = spec.duplication as u64;
    schedule.counts = OpCounts {
        lookups: base_counts.lookups * d,
        stored_events: base_counts.stored_events * d,
        removed_events: base_counts.removed_events * d,
        cleared_events: base_counts.cleared_events * d,
        lookup_blocks: base_counts.lookup_blocks * d,
        stored_blocks: base_counts.stored_blocks * d,
        removed_blocks: base_counts.removed_blocks * d,
        batches: base_counts.batches * d,
    };
    schedule.total_workers = (spec.workers * spec.duplication) as u64;
    // The shifts may reach past the window.
    schedule.span_nanos = span_nanos.max(schedule.ops.last().map_or(0, |o| o.deadline_nanos));
    Ok(schedule)
}

/// Runs one engine over its requests in virtual time; returns its timeline and adds its prompts
/// and batches (counted) to the schedule.
fn run_engine(
    requests: &[SimRequest],
    config: &EngineConfig,
    schedule: &mut IndexSchedule,
) -> Result<Timeline, SimError> {
    let mut engine = Engine::new(*config);
    let mut timeline = Timeline::new();
    let mut order = 0u32;
    let mut now = 0u64;
    let mut next = 0usize;
    loop {
        if !engine.has_work() {
            match requests.get(next) {
                Some(r) => now = now.max(r.arrival_nanos),
                None => break,
            }
        }
        while let Some(request) = requests.get(next).filter(|r| r.arrival_nanos <= now) {
            let prompt = u32::try_from(schedule.prompts.len())
                .map_err(|_| SimError::Internal("more than 2^32 lookups".into()))?;
            schedule.counts.lookups += 1;
            schedule.counts.lookup_blocks += request.prompt.sequence.len() as u64;
            schedule.prompts.push(request.prompt.sequence.clone());
            timeline.push((request.arrival_nanos, order, OpKind::Lookup { prompt }));
            order += 1;
            if config.fits(request) {
                engine.submit(next as RequestId, request);
            } else {
                schedule.dropped_requests += 1;
            }
            next += 1;
        }
        match engine.start_step(requests)? {
            Some(duration) => {
                now += duration;
                let report = engine.finish_step();
                if !report.events.is_empty() {
                    let batch = u32::try_from(schedule.batches.len())
                        .map_err(|_| SimError::Internal("more than 2^32 batches".into()))?;
                    schedule.counts.count_batch(&report.events);
                    schedule.batches.push(report.events);
                    timeline.push((now, order, OpKind::Events { batch }));
                    order += 1;
                }
            }
            // Nothing can run now: wait for the next arrival, or stop when none is left.
            None => match requests.get(next) {
                Some(r) => now = now.max(r.arrival_nanos),
                None => break,
            },
        }
    }
    Ok(timeline)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rows() -> Vec<MooncakeRow> {
        // Two conversations sharing block 0, each with a second turn extending the first.
        let row = |t: f64, ids: &[u64]| MooncakeRow {
            timestamp: t,
            input_length: ids.len() as u64 * 512,
            output_length: 20,
            hash_ids: ids.to_vec(),
            session_id: None,
        };
        vec![
            row(0.0, &[0, 1, 2]),
            row(10.0, &[0, 5, 6]),
            row(2000.0, &[0, 1, 2, 3]),
            row(3000.0, &[0, 5, 6, 7, 8]),
        ]
    }

    fn spec(workers: usize, duplication: usize) -> IndexBenchSpec {
        IndexBenchSpec {
            workers,
            duplication,
            window_nanos: 1_000_000_000,
            rate_scale: 1.0,
            seed: 7,
            engine: EngineConfig {
                block_size: 128,
                kv_blocks: Some(64),
                ..EngineConfig::default()
            },
            max_requests: None,
            spread_ms: 0.0,
        }
    }

    #[test]
    fn duplicates_share_hashes_and_deadlines_and_the_span_is_the_window() {
        let one = build_schedule(&rows(), &spec(2, 1)).expect("builds");
        let three = build_schedule(&rows(), &spec(2, 3)).expect("builds");
        assert_eq!(three.ops.len(), one.ops.len() * 3);
        assert_eq!(three.total_workers, 6);
        assert_eq!(three.counts.lookups, 12);
        assert_eq!(three.counts.logical_ops(), one.counts.logical_ops() * 3);
        assert!(three.counts.stored_blocks > 0);
        // Every op of copy 0 has its copies at the same deadline with the same payload.
        for op in one.ops.iter() {
            for r in 0..3u64 {
                assert!(three.ops.contains(&ScheduledOp {
                    worker_id: op.worker_id + r * 2,
                    ..*op
                }));
            }
        }
        let last = three.ops.last().map(|o| o.deadline_nanos);
        assert_eq!(last, Some(1_000_000_000));
        assert!(
            three
                .ops
                .windows(2)
                .all(|w| w[0].deadline_nanos <= w[1].deadline_nanos)
        );
    }

    #[test]
    fn spread_separates_one_instants_arrivals_and_the_copies_but_keeps_the_work() {
        // Four requests recorded at one instant, plus a later one.
        let mut rows = rows();
        for row in rows.iter_mut().take(2) {
            row.timestamp = 0.0;
        }
        rows[2].timestamp = 0.0;
        let still = build_schedule(&rows, &spec(2, 3)).expect("builds");
        let mut s = spec(2, 3);
        s.spread_ms = 1000.0;
        let spread = build_schedule(&rows, &s).expect("builds");
        // The same lookups and blocks (the engines may batch them into other steps).
        assert_eq!(spread.counts.lookups, still.counts.lookups);
        assert_eq!(spread.counts.lookup_blocks, still.counts.lookup_blocks);
        assert_eq!(spread.counts.stored_blocks, still.counts.stored_blocks);
        let lookup_deadlines = |schedule: &IndexSchedule| {
            let mut d: Vec<u64> = schedule
                .ops
                .iter()
                .filter(|o| matches!(o.kind, OpKind::Lookup { .. }))
                .map(|o| o.deadline_nanos)
                .collect();
            d.dedup();
            d.len()
        };
        // As recorded, the three requests of instant 0 and their copies share one deadline.
        assert!(
            lookup_deadlines(&still) <= 2,
            "{}",
            lookup_deadlines(&still)
        );
        assert!(
            lookup_deadlines(&spread) >= 10,
            "{}",
            lookup_deadlines(&spread)
        );
        assert!(
            spread
                .ops
                .windows(2)
                .all(|w| w[0].deadline_nanos <= w[1].deadline_nanos)
        );
        assert_eq!(
            spread.span_nanos,
            spread
                .ops
                .last()
                .map_or(0, |o| o.deadline_nanos)
                .max(1_000_000_000)
        );
        // Seeded: the same spec gives the same schedule.
        let again = build_schedule(&rows, &s).expect("builds");
        assert_eq!(again.ops, spread.ops);
    }

    #[test]
    fn a_small_pool_evicts_and_a_session_stays_on_one_engine() {
        let mut s = spec(1, 1);
        s.engine.kv_blocks = Some(24);
        let schedule = build_schedule(&rows(), &s).expect("builds");
        assert!(schedule.counts.removed_blocks > 0, "{:?}", schedule.counts);
        assert_eq!(schedule.dropped_requests, 0);
        // The two turns of a conversation are looked up from the same worker.
        let schedule = build_schedule(&rows(), &spec(8, 1)).expect("builds");
        let lookups: Vec<_> = schedule
            .ops
            .iter()
            .filter(|o| matches!(o.kind, OpKind::Lookup { .. }))
            .map(|o| o.worker_id)
            .collect();
        assert_eq!(lookups.len(), 4);
        assert_eq!(lookups[0], lookups[2]);
        assert_eq!(lookups[1], lookups[3]);
    }

    #[test]
    fn bad_knobs_are_named() {
        let mut s = spec(0, 1);
        let err = build_schedule(&rows(), &s).expect_err("no workers");
        assert!(err.to_string().contains("workers"), "{err}");
        s.workers = 1;
        s.rate_scale = 0.0;
        let err = build_schedule(&rows(), &s).expect_err("bad rate");
        assert!(err.to_string().contains("rate-scale"), "{err}");
    }
}
