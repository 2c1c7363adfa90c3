//! Load reported by the engines themselves (vLLM's and SGLang's `/metrics`), which sees requests
//! that never passed through this router: other routers, direct clients.
//!
//! An edge polls the engines and calls [`Selector::report_engine_load`]; the selector keeps the
//! latest report per rank (at most one per rank of a known worker; a worker's reports go with
//! it). While a report is at most [`SelectorConfig::engine_load_max_age`] old, `candidates()`
//! raises the booked load to it, never lowers it: the bookings stay the floor, because a
//! request booked here may not have reached the engine's scheduler yet. Stale reports are
//! ignored, so without reports (or with a silent engine) the bookings alone decide, as before.
//! The cost formula itself is untouched: the report only corrects its inputs.

use super::*;
use crate::event::Rank;
use crate::schedule::Candidate;

/// The default [`SelectorConfig::engine_load_max_age`]: a few poll intervals.
pub const DEFAULT_ENGINE_LOAD_MAX_AGE: Duration = Duration::from_secs(2);

/// One rank's load as its engine reports it.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct EngineLoad {
    /// Requests the engine is running (decoding or prefilling).
    pub running: u64,
    /// Requests waiting in the engine's own queue.
    pub waiting: u64,
    /// The fraction of the engine's KV cache in use, in `[0, 1]`, when it says.
    pub kv_usage: Option<f64>,
}

/// The kept reports: the latest per rank, with the time it was taken.
pub(super) type EngineLoads = HashMap<Rank, (EngineLoad, Instant)>;

impl Selector {
    /// Records `rank`'s engine-reported load as of `now`, replacing its previous report. The
    /// rank must belong to a known worker (so the kept reports stay bounded by the catalog), and
    /// `kv_usage` must be a finite fraction in `[0, 1]`.
    pub fn report_engine_load(
        &self,
        rank: Rank,
        load: EngineLoad,
        now: Instant,
    ) -> Result<(), Error> {
        self.check_running()?;
        if let Some(usage) = load.kv_usage
            && !(usage.is_finite() && (0.0..=1.0).contains(&usage))
        {
            return Err(Error::InvalidField {
                field: "kv_usage",
                message: format!("kv_usage must be a finite fraction in [0, 1], got {usage}"),
            });
        }
        let Some(record) = self.workers.get(&rank.worker_id) else {
            return Err(Error::WorkerNotFound {
                worker_id: rank.worker_id,
            });
        };
        if !record.spec.dp_ranks().contains(&rank.dp_rank) {
            return Err(Error::InvalidField {
                field: "dp_rank",
                message: format!(
                    "worker {} has no dp_rank {} (its ranks are {:?})",
                    rank.worker_id,
                    rank.dp_rank,
                    record.spec.dp_ranks()
                ),
            });
        }
        locked(&self.engine_loads).insert(rank, (load, now));
        self.engine_loads_reported
            .store(true, std::sync::atomic::Ordering::Release);
        Ok(())
    }

    /// `rank`'s latest report if it is at most `engine_load_max_age` old at `now`.
    pub fn engine_load(&self, rank: Rank, now: Instant) -> Option<EngineLoad> {
        let max_age = self.config.engine_load_max_age;
        locked(&self.engine_loads)
            .get(&rank)
            .filter(|(_, at)| now.saturating_duration_since(*at) <= max_age)
            .map(|(load, _)| *load)
    }

    /// How many reports are kept (one per reporting rank of a known worker).
    pub fn engine_load_count(&self) -> usize {
        locked(&self.engine_loads).len()
    }

    /// Drops the reports of `worker_id`'s ranks not in `keep` (all of them for a deleted worker).
    pub(super) fn forget_engine_loads(&mut self, worker_id: WorkerId, keep: std::ops::Range<u32>) {
        exclusive(&mut self.engine_loads)
            .retain(|rank, _| rank.worker_id != worker_id || keep.contains(&rank.dp_rank));
    }
}

/// Raises a candidate's booked load to its engine's fresh report: requests to running plus
/// waiting, decode blocks to the reported KV usage of the worker's `total_kv_blocks` (and the
/// potential decode blocks by the same amount, since they include the active ones).
pub(super) fn correct(candidate: &mut Candidate, report: &EngineLoad) {
    let reported_requests = report.running.saturating_add(report.waiting);
    candidate.active_requests = candidate.active_requests.max(reported_requests);
    if let (Some(usage), Some(total)) = (report.kv_usage, candidate.total_kv_blocks) {
        // `usage` is validated to [0, 1], so the product fits in u64 (`as` saturates anyway).
        let reported_blocks = (usage * total as f64).round() as u64;
        if reported_blocks > candidate.active_decode_blocks {
            let raise = reported_blocks - candidate.active_decode_blocks;
            candidate.active_decode_blocks = reported_blocks;
            candidate.potential_decode_blocks =
                candidate.potential_decode_blocks.saturating_add(raise);
        }
    }
}
