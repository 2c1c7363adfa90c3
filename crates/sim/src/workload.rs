//! Workloads: what arrives when, with which prompt (as block hashes) and how many output tokens.
//!
//! - **Mooncake JSONL** (the FAST'25 traces): one request per line, `timestamp` (ms),
//!   `input_length`, `output_length` and `hash_ids`, each id standing for a 512-token block
//!   *together with every block before it*. Each id is expanded into 512 deterministic tokens that
//!   depend only on the id and the position inside it, so equal ids give equal tokens and a
//!   prompt's tokens are its ids' tokens end to end (the last id usually covers a partial block).
//!   The tokens are then hashed with the simulated engines' block size, exactly like real text.
//! - **Synthetic shared-prefix groups**: `groups × prompts` requests; the prompts of one group share
//!   a system prompt, each has its own question; arrivals are Poisson at a given rate, groups
//!   interleaved at random (seeded).
//!
//! - **Agentic** ([`agentic`], `--synthetic agentic`): tenants with shared system prompts,
//!   multi-turn sessions whose context grows with each tool output, think times, fan-out bursts
//!   and one-shot requests, each request tagged with its session.
//!
//! Arrival times can be compressed (`arrival_speedup`) or rescaled to a mean rate, and the
//! workload cut to its first `max_requests` requests.

use crate::SimError;
use crate::timing::Nanos;
use kvroute_core::hash::{BASE_SEED, PromptHashes};
use rand::rngs::SmallRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use serde::Deserialize;
use std::io::BufRead;

pub mod agentic;
pub use agentic::{AgenticSpec, agentic_workload};

/// Tokens per `hash_ids` entry in the Mooncake traces.
pub const MOONCAKE_BLOCK_TOKENS: usize = 512;

/// One request of a workload.
#[derive(Debug, Clone, PartialEq)]
pub struct SimRequest {
    /// Arrival time, virtual nanoseconds from the start of the run.
    pub arrival_nanos: Nanos,
    /// The prompt hashed with the engines' block size (`isl_tokens` is its length).
    pub prompt: PromptHashes,
    /// Tokens to generate (at least 1 is generated).
    pub output_tokens: u64,
    /// The conversation or agent session the request belongs to, when the workload knows it
    /// (the agentic workload does; a trace's `session_id`, or its opening blocks with
    /// [`sessions_by_opening`]); the session policies route on it.
    pub session_id: Option<u64>,
    /// The tenant it belongs to, when the workload knows it (the agentic workload does); the
    /// router-side queue shares capacity between tenants (fairness).
    pub tenant: Option<u32>,
}

/// A workload, ready to replay.
#[derive(Debug, Clone, PartialEq)]
pub struct Workload {
    /// Where it came from (a trace path or a synthetic description), for the report.
    pub name: String,
    /// The block size the prompts are hashed with.
    pub block_size: u32,
    /// Requests in arrival order.
    pub requests: Vec<SimRequest>,
}

impl Workload {
    /// Total prompt tokens.
    pub fn prompt_tokens(&self) -> u64 {
        self.requests.iter().map(|r| r.prompt.isl_tokens).sum()
    }
}

/// How arrivals are replayed.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ArrivalOptions {
    /// Arrival times are divided by this (2.0 replays twice as fast).
    pub speedup: f64,
    /// When set, arrival times are rescaled so the mean rate is this many requests per second
    /// (applied instead of `speedup`).
    pub rate_rps: Option<f64>,
    /// Keep only the first N requests.
    pub max_requests: Option<usize>,
}

impl Default for ArrivalOptions {
    fn default() -> Self {
        Self {
            speedup: 1.0,
            rate_rps: None,
            max_requests: None,
        }
    }
}

impl ArrivalOptions {
    pub fn validate(&self) -> Result<(), SimError> {
        if !(self.speedup.is_finite() && self.speedup > 0.0) {
            return Err(SimError::invalid(
                "arrival-speedup",
                format!("must be a positive number, got {}", self.speedup),
            ));
        }
        if let Some(rate) = self.rate_rps
            && !(rate.is_finite() && rate > 0.0)
        {
            return Err(SimError::invalid(
                "rate",
                format!("must be a positive number of requests per second, got {rate}"),
            ));
        }
        if self.max_requests == Some(0) {
            return Err(SimError::invalid("max-requests", "must be greater than 0"));
        }
        Ok(())
    }
}

/// One line of a Mooncake trace. Unknown keys (`delay`, ...) are ignored.
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct MooncakeRow {
    /// Arrival, milliseconds from the start of the trace.
    pub timestamp: f64,
    pub input_length: u64,
    pub output_length: u64,
    pub hash_ids: Vec<u64>,
    /// The request's session, when the trace has one (the FAST'25 traces do not).
    #[serde(default)]
    pub session_id: Option<u64>,
}

/// Gives each trace request without a `session_id` the session its opening names: its first
/// two 512-token `hash_ids` (its first alone when it has one). The conversation trace starts
/// every request with the same block 0 (a shared system prompt), so the second block is where
/// a conversation's own context starts; its later turns extend that prompt and keep it. Requests
/// that merely share a long system prompt with no own context look like one session, so this is
/// an approximation: the trace records no sessions.
pub fn sessions_by_opening(rows: &mut [MooncakeRow]) {
    for row in rows.iter_mut().filter(|r| r.session_id.is_none()) {
        let first = row.hash_ids.first().copied();
        let second = row.hash_ids.get(1).copied();
        row.session_id = match (first, second) {
            // Pairs of ids below 2^32 (the traces' ids are 0..N) map to distinct sessions.
            (Some(a), Some(b)) => Some(a.wrapping_mul(1 << 32) ^ b),
            (Some(a), None) => Some(a.wrapping_mul(1 << 32) ^ u64::from(u32::MAX)),
            _ => None,
        };
    }
}

/// Parses a Mooncake JSONL trace. Blank lines are skipped; a bad line is an error naming it.
pub fn parse_mooncake(reader: impl BufRead) -> Result<Vec<MooncakeRow>, SimError> {
    let mut rows = Vec::new();
    let mut previous = 0.0f64;
    for (i, line) in reader.lines().enumerate() {
        let line_no = i + 1;
        let line = line.map_err(|e| SimError::Trace {
            line: line_no,
            reason: format!("cannot read: {e}"),
        })?;
        if line.trim().is_empty() {
            continue;
        }
        let row: MooncakeRow = serde_json::from_str(&line).map_err(|e| SimError::Trace {
            line: line_no,
            reason: e.to_string(),
        })?;
        if !(row.timestamp.is_finite() && row.timestamp >= 0.0) {
            return Err(SimError::Trace {
                line: line_no,
                reason: format!(
                    "timestamp must be a non-negative number, got {}",
                    row.timestamp
                ),
            });
        }
        if row.timestamp < previous {
            return Err(SimError::Trace {
                line: line_no,
                reason: format!(
                    "timestamps must not decrease ({} after {previous})",
                    row.timestamp
                ),
            });
        }
        if row.input_length == 0 {
            return Err(SimError::Trace {
                line: line_no,
                reason: "input_length must be greater than 0".into(),
            });
        }
        previous = row.timestamp;
        rows.push(row);
    }
    Ok(rows)
}

/// Mixes a 64-bit value (splitmix64's finaliser).
pub(crate) fn mix64(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// Appends `len` tokens of the segment named `key`: token `j` depends only on `(key, j)`.
pub(crate) fn push_segment(tokens: &mut Vec<u32>, key: u64, len: usize) {
    let base = mix64(key);
    tokens.extend(
        (0..len as u64).map(|j| (mix64(base ^ j.wrapping_mul(0xd6e8_feb8_6659_fd93)) >> 32) as u32),
    );
}

/// Segment keys of different kinds never collide with Mooncake ids (which are < 2^61).
const UNIQUE_SEGMENT: u64 = 1 << 63;
const SYSTEM_SEGMENT: u64 = 1 << 62;
const QUESTION_SEGMENT: u64 = 3 << 61;

/// The tokens of one Mooncake row: each id expands to 512 tokens, cut at `input_length`; tokens
/// past the ids' coverage (a malformed row) are unique to the row.
pub fn mooncake_tokens(row: &MooncakeRow, row_index: usize) -> Vec<u32> {
    let len = row.input_length as usize;
    let mut tokens = Vec::with_capacity(len);
    for &id in &row.hash_ids {
        if tokens.len() >= len {
            break;
        }
        let take = MOONCAKE_BLOCK_TOKENS.min(len - tokens.len());
        push_segment(&mut tokens, id & !(7 << 61), take);
    }
    if tokens.len() < len {
        let missing = len - tokens.len();
        push_segment(&mut tokens, UNIQUE_SEGMENT | row_index as u64, missing);
    }
    tokens
}

/// Arrival times in nanoseconds for timestamps in milliseconds, after the replay options.
fn scale_arrivals(timestamps_ms: &[f64], arrival: &ArrivalOptions) -> Vec<Nanos> {
    let first = timestamps_ms.first().copied().unwrap_or(0.0);
    let last = timestamps_ms.last().copied().unwrap_or(0.0);
    let n = timestamps_ms.len();
    let factor = match arrival.rate_rps {
        Some(rate) if n > 1 && last > first => {
            let observed_rps = (n - 1) as f64 / ((last - first) / 1000.0);
            observed_rps / rate
        }
        _ => 1.0 / arrival.speedup,
    };
    timestamps_ms
        .iter()
        .enumerate()
        .map(|(i, &t)| match arrival.rate_rps {
            // Every request at one instant: spread them evenly at the requested rate.
            Some(rate) if last <= first => (i as f64 / rate * 1e9).round() as Nanos,
            _ => ((t - first) * factor * 1e6).round() as Nanos,
        })
        .collect()
}

fn validate_block_size(block_size: u32) -> Result<(), SimError> {
    if block_size == 0 {
        return Err(SimError::invalid("block-size", "must be greater than 0"));
    }
    Ok(())
}

/// Builds a workload from Mooncake rows.
pub fn mooncake_workload(
    name: &str,
    rows: &[MooncakeRow],
    block_size: u32,
    arrival: &ArrivalOptions,
) -> Result<Workload, SimError> {
    arrival.validate()?;
    validate_block_size(block_size)?;
    let rows = &rows[..arrival.max_requests.unwrap_or(rows.len()).min(rows.len())];
    let timestamps: Vec<f64> = rows.iter().map(|r| r.timestamp).collect();
    let arrivals = scale_arrivals(&timestamps, arrival);
    let requests = rows
        .iter()
        .zip(arrivals)
        .enumerate()
        .map(|(i, (row, arrival_nanos))| SimRequest {
            arrival_nanos,
            prompt: PromptHashes::from_tokens(
                &mooncake_tokens(row, i),
                block_size as usize,
                BASE_SEED,
            ),
            output_tokens: row.output_length,
            session_id: row.session_id,
            tenant: None,
        })
        .collect();
    Ok(Workload {
        name: name.to_string(),
        block_size,
        requests,
    })
}

/// Synthetic shared-prefix groups.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SyntheticSpec {
    pub groups: usize,
    pub prompts_per_group: usize,
    /// Tokens of each group's shared system prompt.
    pub system_prompt_tokens: usize,
    /// Tokens of each prompt's own question (after the system prompt).
    pub question_tokens: usize,
    pub output_tokens: u64,
    /// Mean Poisson arrival rate, requests per second (before `ArrivalOptions`).
    pub rate_rps: f64,
    pub seed: u64,
}

impl Default for SyntheticSpec {
    fn default() -> Self {
        Self {
            groups: 16,
            prompts_per_group: 64,
            system_prompt_tokens: 4_096,
            question_tokens: 512,
            output_tokens: 256,
            rate_rps: 16.0,
            seed: 0,
        }
    }
}

impl SyntheticSpec {
    /// Parses `GROUPSxPROMPTS` (e.g. `16x64`) into the group shape.
    pub fn parse_shape(shape: &str) -> Result<(usize, usize), SimError> {
        let bad = || {
            SimError::invalid(
                "synthetic",
                format!("expected GROUPSxPROMPTS such as 16x64, got `{shape}`"),
            )
        };
        let (g, p) = shape.split_once(['x', 'X']).ok_or_else(bad)?;
        let groups: usize = g.trim().parse().map_err(|_| bad())?;
        let prompts: usize = p.trim().parse().map_err(|_| bad())?;
        if groups == 0 || prompts == 0 {
            return Err(bad());
        }
        Ok((groups, prompts))
    }

    /// `synthetic 16x64 (system prompt 4096 + question 512 tokens, output 256 tokens, 16 req/s)`.
    pub fn describe(&self) -> String {
        format!(
            "synthetic {}x{} (system prompt {} + question {} tokens, output {} tokens, {} req/s)",
            self.groups,
            self.prompts_per_group,
            self.system_prompt_tokens,
            self.question_tokens,
            self.output_tokens,
            self.rate_rps
        )
    }
}

/// Builds a synthetic shared-prefix workload.
pub fn synthetic_workload(
    spec: &SyntheticSpec,
    block_size: u32,
    arrival: &ArrivalOptions,
) -> Result<Workload, SimError> {
    arrival.validate()?;
    validate_block_size(block_size)?;
    if spec.system_prompt_tokens + spec.question_tokens == 0 {
        return Err(SimError::invalid(
            "system-prompt-tokens",
            "system prompt and question cannot both be empty",
        ));
    }
    if !(spec.rate_rps.is_finite() && spec.rate_rps > 0.0) {
        return Err(SimError::invalid(
            "rate",
            format!("must be a positive number, got {}", spec.rate_rps),
        ));
    }
    let mut rng = SmallRng::seed_from_u64(spec.seed ^ 0x5157_4e54_4845_5449);
    let mut order: Vec<usize> = (0..spec.groups)
        .flat_map(|g| std::iter::repeat_n(g, spec.prompts_per_group))
        .collect();
    order.shuffle(&mut rng);
    let total = order.len().min(arrival.max_requests.unwrap_or(usize::MAX));
    let rate = arrival.rate_rps.unwrap_or(spec.rate_rps * arrival.speedup);
    let mut clock_secs = 0.0f64;
    let mut requests = Vec::with_capacity(total);
    for (i, &group) in order.iter().take(total).enumerate() {
        if i > 0 {
            let u: f64 = rng.random();
            clock_secs += -(1.0 - u).ln() / rate;
        }
        let mut tokens = Vec::with_capacity(spec.system_prompt_tokens + spec.question_tokens);
        push_segment(
            &mut tokens,
            SYSTEM_SEGMENT | group as u64,
            spec.system_prompt_tokens,
        );
        push_segment(
            &mut tokens,
            QUESTION_SEGMENT | i as u64,
            spec.question_tokens,
        );
        requests.push(SimRequest {
            arrival_nanos: (clock_secs * 1e9).round() as Nanos,
            prompt: PromptHashes::from_tokens(&tokens, block_size as usize, BASE_SEED),
            output_tokens: spec.output_tokens,
            session_id: None,
            tenant: None,
        });
    }
    Ok(Workload {
        name: SyntheticSpec {
            rate_rps: rate,
            ..*spec
        }
        .describe(),
        block_size,
        requests,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const TRACE: &str = r#"{"timestamp": 0, "input_length": 1000, "output_length": 10, "hash_ids": [0, 1]}

{"timestamp": 27, "input_length": 700, "output_length": 3, "hash_ids": [0, 2], "session_id": 4}
{"timestamp": 3000, "input_length": 512, "output_length": 1, "hash_ids": [5]}
"#;

    #[test]
    fn parses_mooncake_lines_and_ignores_unknown_keys() {
        let rows = parse_mooncake(TRACE.as_bytes()).unwrap();
        assert_eq!(rows.len(), 3);
        assert_eq!(
            rows[1],
            MooncakeRow {
                timestamp: 27.0,
                input_length: 700,
                output_length: 3,
                hash_ids: vec![0, 2],
                session_id: Some(4),
            }
        );
        let workload = mooncake_workload("t", &rows, 64, &ArrivalOptions::default()).unwrap();
        let sessions: Vec<_> = workload.requests.iter().map(|r| r.session_id).collect();
        assert_eq!(sessions, vec![None, Some(4), None]);
    }

    #[test]
    fn sessions_by_opening_name_requests_by_their_first_two_blocks() {
        let mut rows = parse_mooncake(TRACE.as_bytes()).unwrap();
        let mut turn = rows[0].clone();
        turn.hash_ids.push(9);
        rows.push(turn);
        sessions_by_opening(&mut rows);
        let sessions: Vec<_> = rows.iter().map(|r| r.session_id).collect();
        assert_eq!(sessions[1], Some(4), "the trace's own session stays");
        assert_eq!(
            sessions[0], sessions[3],
            "a later turn: same opening, same session"
        );
        assert_ne!(sessions[0], sessions[2]);
        assert!(sessions.iter().all(Option::is_some));
    }

    #[test]
    fn bad_lines_are_named() {
        let err = parse_mooncake("{\"timestamp\": 0}\n".as_bytes()).unwrap_err();
        assert!(err.to_string().contains("line 1"), "{err}");
        assert!(err.to_string().contains("input_length"), "{err}");
        let err = parse_mooncake(
            "{\"timestamp\": 5, \"input_length\": 1, \"output_length\": 1, \"hash_ids\": [0]}\n\
             {\"timestamp\": 4, \"input_length\": 1, \"output_length\": 1, \"hash_ids\": [0]}\n"
                .as_bytes(),
        )
        .unwrap_err();
        assert!(err.to_string().contains("line 2"), "{err}");
        assert!(err.to_string().contains("decrease"), "{err}");
        let err = parse_mooncake(
            "{\"timestamp\": 0, \"input_length\": 0, \"output_length\": 1, \"hash_ids\": []}"
                .as_bytes(),
        )
        .unwrap_err();
        assert!(err.to_string().contains("input_length"), "{err}");
    }

    #[test]
    fn equal_ids_give_equal_tokens_and_positions_stay_aligned() {
        let rows = parse_mooncake(TRACE.as_bytes()).unwrap();
        let a = mooncake_tokens(&rows[0], 0);
        let b = mooncake_tokens(&rows[1], 1);
        assert_eq!(a.len(), 1000);
        assert_eq!(b.len(), 700);
        // Id 0 is shared: the first 512 tokens agree; ids 1 and 2 differ from token 512 on.
        assert_eq!(a[..512], b[..512]);
        assert_ne!(a[512..700], b[512..700]);
        // Hashed at block size 64, the 8 blocks of id 0 match and nothing after.
        let ha = PromptHashes::from_tokens(&a, 64, BASE_SEED);
        let hb = PromptHashes::from_tokens(&b, 64, BASE_SEED);
        assert_eq!(ha.sequence.len(), 15);
        assert_eq!(hb.sequence.len(), 10);
        assert_eq!(ha.sequence[..8], hb.sequence[..8]);
        assert_ne!(ha.sequence[8], hb.sequence[8]);
        // A row whose id is the same as another's first id expands to the same tokens.
        let c = mooncake_tokens(
            &MooncakeRow {
                timestamp: 0.0,
                input_length: 300,
                output_length: 1,
                hash_ids: vec![0],
                session_id: None,
            },
            9,
        );
        assert_eq!(c[..], a[..300]);
    }

    #[test]
    fn arrivals_are_compressed_or_rescaled() {
        let rows = parse_mooncake(TRACE.as_bytes()).unwrap();
        let plain = mooncake_workload("t", &rows, 64, &ArrivalOptions::default()).unwrap();
        let arrivals: Vec<u64> = plain.requests.iter().map(|r| r.arrival_nanos).collect();
        assert_eq!(arrivals, vec![0, 27_000_000, 3_000_000_000]);
        let fast = ArrivalOptions {
            speedup: 2.0,
            ..ArrivalOptions::default()
        };
        let w = mooncake_workload("t", &rows, 64, &fast).unwrap();
        assert_eq!(w.requests[2].arrival_nanos, 1_500_000_000);
        // 3 requests over 3 s is 2/3 req/s; at 2 req/s the span becomes 1 s.
        let rated = ArrivalOptions {
            rate_rps: Some(2.0),
            ..ArrivalOptions::default()
        };
        let w = mooncake_workload("t", &rows, 64, &rated).unwrap();
        assert_eq!(w.requests[2].arrival_nanos, 1_000_000_000);
        let limited = ArrivalOptions {
            max_requests: Some(2),
            ..ArrivalOptions::default()
        };
        assert_eq!(
            mooncake_workload("t", &rows, 64, &limited)
                .unwrap()
                .requests
                .len(),
            2
        );
        assert!(
            mooncake_workload(
                "t",
                &rows,
                64,
                &ArrivalOptions {
                    speedup: 0.0,
                    ..ArrivalOptions::default()
                }
            )
            .is_err()
        );
    }

    #[test]
    fn synthetic_groups_share_exactly_their_system_prompt() {
        let spec = SyntheticSpec {
            groups: 3,
            prompts_per_group: 4,
            system_prompt_tokens: 200,
            question_tokens: 100,
            output_tokens: 5,
            rate_rps: 10.0,
            seed: 7,
        };
        let w = synthetic_workload(&spec, 64, &ArrivalOptions::default()).unwrap();
        assert_eq!(w.requests.len(), 12);
        assert!(
            w.requests
                .windows(2)
                .all(|p| p[0].arrival_nanos <= p[1].arrival_nanos)
        );
        // 300 tokens → 4 full blocks, of which the first 3 (192 tokens) are pure system prompt.
        let mut by_prefix = std::collections::BTreeMap::new();
        for r in &w.requests {
            assert_eq!(r.prompt.isl_tokens, 300);
            assert_eq!(r.prompt.sequence.len(), 4);
            *by_prefix.entry(r.prompt.sequence[2]).or_insert(0) += 1;
        }
        assert_eq!(
            by_prefix.values().copied().collect::<Vec<_>>(),
            vec![4, 4, 4]
        );
        let fourth: std::collections::BTreeSet<u64> =
            w.requests.iter().map(|r| r.prompt.sequence[3]).collect();
        assert_eq!(
            fourth.len(),
            12,
            "the block holding question tokens is unique"
        );
        // Same seed, same workload.
        assert_eq!(
            w,
            synthetic_workload(&spec, 64, &ArrivalOptions::default()).unwrap()
        );
    }

    #[test]
    fn synthetic_shape_parses() {
        assert_eq!(SyntheticSpec::parse_shape("16x64").unwrap(), (16, 64));
        assert!(SyntheticSpec::parse_shape("16").is_err());
        assert!(SyntheticSpec::parse_shape("0x4").is_err());
    }
}
