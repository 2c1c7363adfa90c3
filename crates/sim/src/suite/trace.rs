//! `trace`: a Mooncake JSONL trace as an extra shape (`--suite-trace PATH`), its first
//! [`MAX_REQUESTS`] requests at the recorded arrival times (1×).

use super::{MAX_REQUESTS, Shape};
use crate::SimError;
use crate::workload::{ArrivalOptions, MooncakeRow, SimRequest, mooncake_workload};

pub struct TraceShape {
    /// Where the rows came from, for the description.
    pub source: String,
    pub rows: Vec<MooncakeRow>,
}

impl Shape for TraceShape {
    fn name(&self) -> &str {
        "trace"
    }

    fn description(&self) -> String {
        format!(
            "the first {} requests of {} at its recorded arrival times",
            self.rows.len().min(MAX_REQUESTS),
            self.source
        )
    }

    fn generate(&self, _seed: u64, block_size: u32) -> Result<Vec<SimRequest>, SimError> {
        let arrival = ArrivalOptions {
            max_requests: Some(MAX_REQUESTS),
            ..ArrivalOptions::default()
        };
        Ok(mooncake_workload(&self.source, &self.rows, block_size, &arrival)?.requests)
    }
}
