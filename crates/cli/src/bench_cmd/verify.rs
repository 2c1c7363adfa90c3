//! The correctness check: the schedule applied in order, without timing, to a fresh `Selector`
//! and to the naive reference index (`kvroute_core::index::reference`); every `k`-th lookup's
//! answer from the selector's index walk must equal the reference's.

use super::{fleet_selector, partition};
use kvroute_core::event::Rank;
use kvroute_core::index::reference::ReferenceIndex;
use kvroute_sim::index_bench::{IndexSchedule, OpKind};

/// What the check found.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct VerifyReport {
    pub checked: u64,
    pub mismatches: u64,
    /// Checked lookups some rank overlapped (a check of empty answers alone proves little).
    pub nonempty: u64,
}

/// Checks about `sample` lookups spread evenly over the schedule.
pub fn verify(
    schedule: &IndexSchedule,
    block_size: u32,
    sample: usize,
) -> Result<VerifyReport, String> {
    let mut selector = fleet_selector(schedule.total_workers, block_size)?;
    let mut reference = ReferenceIndex::default();
    let partition = partition();
    let every = (schedule.counts.lookups as usize / sample.max(1)).max(1);
    let mut report = VerifyReport::default();
    let mut lookup = 0usize;
    for op in &schedule.ops {
        match op.kind {
            OpKind::Events { batch } => {
                let events = &schedule.batches[batch as usize];
                selector.apply_events(op.worker_id, 0, events);
                for event in events {
                    reference.apply(Rank::new(op.worker_id, 0), event);
                }
            }
            OpKind::Lookup { prompt } => {
                lookup += 1;
                if !lookup.is_multiple_of(every) {
                    continue;
                }
                let hashes = &schedule.prompts[prompt as usize];
                let got = selector
                    .index_overlaps(&partition, hashes)
                    .ok_or("the bench partition has no index")?;
                let want = reference.find_matches(hashes).ranks;
                report.checked += 1;
                report.nonempty += u64::from(!want.is_empty());
                if got != want {
                    report.mismatches += 1;
                }
            }
        }
    }
    Ok(report)
}
