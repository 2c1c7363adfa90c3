//! Scheduling (SPEC §6): the cost of sending a prompt to each eligible rank, and the pick.
//!
//! Two costs, by [`RouterProfile`] (lower is better).
//!
//! **`dynamo`** — Dynamo 1.6.1's, in blocks:
//! ```text
//! prefill_blocks = (active_prefill_tokens + isl_tokens) / block_size            (real-valued)
//! credit         = overlap_score_credit * device_blocks
//!                + host_cache_hit_weight * (host_blocks - device_blocks)
//!                + disk_cache_hit_weight * (disk_blocks - host_blocks)
//! cost           = prefill_load_scale * max(0, prefill_blocks - credit)
//!                + potential_decode_blocks + decode_active_request_weight * active_requests
//! ```
//!
//! **`kvroute`** (the default) — what the fleet loses, in predicted milliseconds: this request's
//! time to first token on the rank, plus the time the requests already running there lose to it,
//! plus its own decode time, with the speeds of `crate::speed` (a prior, corrected online by what
//! the lifecycle calls measure):
//! ```text
//! u        = max(0, isl_tokens - overlap_score_credit * cached_tokens)   cached by engine tier
//! n        = active_requests,  kv = active_decode_blocks * block_size,  kv' = after booking
//! L        = expected output tokens (the request's, else the mean measured)
//! ttft     = prefill_ms_per_token * active_prefill_tokens + prefill(u)
//! stall    = n * prefill(u)                      every running request waits out its prefill
//! decode   = L * decode_step(n + 1, kv')         its own decode, slowed by the others
//!          + n * L * (decode_step(n + 1, kv') - decode_step(n, kv))   the others', slowed by it
//! cost     = prefill_load_scale * ttft + stall + decode + decode_active_request_weight * n
//! ```
//! `prefill_load_scale` weighs the request's own time to first token against the time the others
//! lose (32 by default, [`SchedulerConfig::for_profile`]). A prefix holder wins while the prefill
//! it saves outweighs what its running batch loses; a holder whose batch has grown loses to a
//! less loaded rank, which then becomes a holder too (the prompt is predicted there on route), so
//! a hot prefix gains holders as its demand grows, and as demand falls the holders' batches
//! shrink and the existing holders win again.
//!
//! **Disaggregated prefill and decode** (SPEC §6.1) cost each leg on its own pool, by [`Leg`]:
//! a prefill leg is a request with one output token (the same formula with `L = 1`) plus
//! `prefill_load_scale * prefill(u)` once more: a prefill pool is a queue, so the prompts routed
//! to the rank after this one wait out its prefill as it waits out theirs (measured in the
//! simulator: without it the pick leaves the prefix holder too often, `crates/sim/README.md`);
//! a decode leg computes no
//! prompt, so its time to first token is the prefill queued on the rank (bypassed requests) plus
//! the KV transfer of what the rank does not hold, and the rest is the decode terms:
//! ```text
//! ttft_d   = prefill_ms_per_token * active_prefill_tokens + decode_step(n + 1, kv')
//! cost_d   = prefill_load_scale * ttft_d + transfer(isl_tokens - device_tokens)
//!          + decode + decode_active_request_weight * n
//! ```
//! so a decode worker gets cache credit only for the blocks it really holds (less to move). The
//! transfer is counted at its time, unweighted: weighed like the time to first token it kept
//! long contexts on the decode workers that held them and raised ITL p99 in the simulator.
//! Under `dynamo` a prefill leg costs the block cost and a decode leg
//! `potential_decode_blocks + decode_active_request_weight * active_requests`.
//!
//! Temperature 0 picks the lowest cost, exact ties broken uniformly at random; temperature T > 0
//! min-max normalises the costs to [0, 1] and samples with p ∝ exp(−cost / T). The random source
//! is an argument, so tests and the simulator are deterministic.
//!
//! What a select reports and a booking carries as `effective_prefill_tokens` — the tokens the
//! engine will still compute — depends on the profile: under `kvroute` it is the prompt minus its
//! cached tokens weighted by tier as the engine pays for them ([`ENGINE_TIER_WEIGHTS`]), whatever
//! the weights; under `dynamo` it is Dynamo 1.6.1's formula, in which the routing credit leaks in.

use crate::event::Rank;
use crate::speed::EngineSpeeds;
use rand::Rng;
use std::fmt;
use std::str::FromStr;

/// Which part of a request a pick is for (SPEC §6.1).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Leg {
    /// The whole request on one worker.
    #[default]
    Whole,
    /// The prefill leg of a disaggregated request: the prompt and one output token.
    Prefill,
    /// The decode leg of a disaggregated request: the prompt's KV moved in, then the output.
    Decode,
}

/// Which defaults the router starts from, and how it counts a prompt's effective prefill.
///
/// The defaults of every edge (`kvroute serve`, `kvroute.SelectionService()`, the simulator's
/// `kvroute` and `dynamo` policies) come from [`SchedulerConfig::for_profile`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum RouterProfile {
    /// kvroute's own cost, in predicted time (see the module documentation); effective prefill
    /// is what the engine will compute, independent of the weights.
    #[default]
    Kvroute,
    /// Dynamo 1.6.1's weights and effective-prefill formula, for identical decisions.
    Dynamo,
}

impl RouterProfile {
    /// Every profile, default first.
    pub const ALL: [RouterProfile; 2] = [RouterProfile::Kvroute, RouterProfile::Dynamo];

    /// The profile's name on the command line and in Python.
    pub fn name(self) -> &'static str {
        match self {
            RouterProfile::Kvroute => "kvroute",
            RouterProfile::Dynamo => "dynamo",
        }
    }
}

impl fmt::Display for RouterProfile {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for RouterProfile {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        RouterProfile::ALL
            .into_iter()
            .find(|p| p.name() == s)
            .ok_or_else(|| format!("unknown router profile {s:?} (known: kvroute, dynamo)"))
    }
}

/// What a cached block saves the engine, by tier (device, host, disk): a device block is not
/// computed again, a host or disk block costs a transfer. Facts about the engine, not routing
/// weights; the `kvroute` profile's effective prefill uses them.
pub const ENGINE_TIER_WEIGHTS: (f64, f64, f64) = (1.0, 0.75, 0.25);

/// `device_w × device + host_w × (host − device) + disk_w × (disk − host)`, over cumulative tiers.
fn tier_credit(
    weights: (f64, f64, f64),
    device_blocks: u32,
    host_blocks: u32,
    disk_blocks: u32,
) -> f64 {
    let device = f64::from(device_blocks);
    let host = f64::from(host_blocks.max(device_blocks));
    let disk = f64::from(disk_blocks.max(host_blocks).max(device_blocks));
    weights.0 * device + weights.1 * (host - device) + weights.2 * (disk - host)
}

/// Scheduler weights and thresholds; every one is a service flag.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SchedulerConfig {
    /// The profile these settings started from; it also picks the effective-prefill formula.
    pub profile: RouterProfile,
    pub overlap_score_credit: f64,
    pub prefill_load_scale: f64,
    pub host_cache_hit_weight: f64,
    pub disk_cache_hit_weight: f64,
    pub decode_active_request_weight: f64,
    pub router_temperature: f64,
    /// Whether bookings count their effective prefill tokens as load until prefill completes.
    pub track_prefill_tokens: bool,
    /// A rank is busy when its active decode blocks reach this fraction of `total_kv_blocks`.
    pub busy_decode_fraction: Option<f64>,
    /// A rank is busy when its active prefill tokens reach this many.
    pub busy_prefill_tokens: Option<u64>,
    /// A rank is busy when its active prefill tokens reach this fraction of
    /// `max_num_batched_tokens`.
    pub busy_prefill_fraction: Option<f64>,
    /// The engine speeds the `kvroute` cost assumes before it has measured any (`crate::speed`).
    pub engine: EngineSpeeds,
}

impl SchedulerConfig {
    /// A profile's defaults: the one place they are written down.
    ///
    /// `dynamo` is Dynamo 1.6.1's (SPEC §6). `kvroute` costs in predicted time (the module
    /// documentation), where the same two weights mean: `overlap_score_credit` 1, a cached
    /// token saves one token of prefill; `prefill_load_scale` 32, the request's own time to first
    /// token weighs 32 times a millisecond lost by one of the requests already running. Users
    /// wait on the first token; the running requests' losses are spread over their streams. The
    /// weight is a preference measured on the simulator's suite (six workload shapes, four
    /// loads, one and two routers, two engine models; `crates/sim/README.md`), where 8, 16, 32
    /// and 64 were tried; the judgement of cache against load comes from the measured speeds.
    pub fn for_profile(profile: RouterProfile) -> Self {
        let dynamo = Self {
            profile,
            overlap_score_credit: 1.0,
            prefill_load_scale: 1.0,
            host_cache_hit_weight: 0.75,
            disk_cache_hit_weight: 0.25,
            decode_active_request_weight: 0.0,
            router_temperature: 0.0,
            track_prefill_tokens: true,
            busy_decode_fraction: None,
            busy_prefill_tokens: None,
            busy_prefill_fraction: None,
            engine: EngineSpeeds::default(),
        };
        match profile {
            RouterProfile::Dynamo => dynamo,
            RouterProfile::Kvroute => Self {
                prefill_load_scale: 32.0,
                ..dynamo
            },
        }
    }
}

impl Default for SchedulerConfig {
    /// The default profile's settings (`kvroute`).
    fn default() -> Self {
        Self::for_profile(RouterProfile::default())
    }
}

/// Per-request changes to the scheduler (`router_config_override`).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Overrides {
    pub overlap_score_credit: Option<f64>,
    pub prefill_load_scale: Option<f64>,
    pub router_temperature: Option<f64>,
    pub track_prefill_tokens: Option<bool>,
}

impl SchedulerConfig {
    /// This configuration with a request's overrides applied.
    pub fn with(&self, overrides: &Overrides) -> SchedulerConfig {
        SchedulerConfig {
            overlap_score_credit: overrides
                .overlap_score_credit
                .unwrap_or(self.overlap_score_credit),
            prefill_load_scale: overrides
                .prefill_load_scale
                .unwrap_or(self.prefill_load_scale),
            router_temperature: overrides
                .router_temperature
                .unwrap_or(self.router_temperature),
            track_prefill_tokens: overrides
                .track_prefill_tokens
                .unwrap_or(self.track_prefill_tokens),
            ..*self
        }
    }

    /// The cache credit, in blocks, of a rank's cumulative tier overlaps (routing weights).
    pub fn credit(&self, device_blocks: u32, host_blocks: u32, disk_blocks: u32) -> f64 {
        tier_credit(
            (
                self.overlap_score_credit,
                self.host_cache_hit_weight,
                self.disk_cache_hit_weight,
            ),
            device_blocks,
            host_blocks,
            disk_blocks,
        )
    }

    /// The tokens the engine will still prefill for an `isl_tokens` prompt with these cumulative
    /// tier overlaps: what a select reports and a booking carries. Under the `kvroute` profile
    /// the cached tokens are weighted by [`ENGINE_TIER_WEIGHTS`], never by the routing weights;
    /// under `dynamo`, by the routing credit, as Dynamo 1.6.1 does.
    pub fn effective_prefill_tokens(
        &self,
        isl_tokens: u64,
        block_size: u32,
        device_blocks: u32,
        host_blocks: u32,
        disk_blocks: u32,
    ) -> u64 {
        let credit = match self.profile {
            RouterProfile::Kvroute => {
                tier_credit(ENGINE_TIER_WEIGHTS, device_blocks, host_blocks, disk_blocks)
            }
            RouterProfile::Dynamo => self.credit(device_blocks, host_blocks, disk_blocks),
        };
        effective_prefill_tokens(isl_tokens, block_size, credit)
    }

    /// The cost of one candidate (lower is better): by the profile, in blocks or in predicted
    /// milliseconds (the module documentation).
    pub fn cost(&self, c: &Candidate, isl_tokens: u64, block_size: u32) -> f64 {
        match self.profile {
            RouterProfile::Dynamo => self.block_cost(c, isl_tokens, block_size),
            RouterProfile::Kvroute => self.time_cost(c, isl_tokens, block_size),
        }
    }

    /// The cost of one candidate for one leg of a request (the module documentation).
    pub fn leg_cost(&self, leg: Leg, c: &Candidate, isl_tokens: u64, block_size: u32) -> f64 {
        match (leg, self.profile) {
            (Leg::Whole, _) => self.cost(c, isl_tokens, block_size),
            (Leg::Prefill, RouterProfile::Dynamo) => self.block_cost(c, isl_tokens, block_size),
            (Leg::Prefill, RouterProfile::Kvroute) => {
                let mut one_token = *c;
                one_token.speeds.output_tokens = 1.0;
                // A prefill pool is a queue: every prompt routed to this rank after this one
                // waits out its prefill too, which a rank running decodes does not make them
                // do. Weighed as its own time to first token is.
                let queued_behind =
                    self.prefill_load_scale * self.own_prefill_cost(c, isl_tokens, block_size);
                self.time_cost(&one_token, isl_tokens, block_size) + queued_behind
            }
            (Leg::Decode, RouterProfile::Dynamo) => {
                c.potential_decode_blocks as f64
                    + self.decode_active_request_weight * c.active_requests as f64
            }
            (Leg::Decode, RouterProfile::Kvroute) => {
                self.decode_leg_cost(c, isl_tokens, block_size)
            }
        }
    }

    fn decode_leg_cost(&self, c: &Candidate, isl_tokens: u64, block_size: u32) -> f64 {
        let s = &c.speeds;
        let bs = f64::from(block_size.max(1));
        let n = c.active_requests as f64;
        let held = f64::from(c.device_blocks) * bs;
        let (step_with, added_step) = self.decode_steps(c, bs);
        let ttft = s.prefill_ms_per_token * c.active_prefill_tokens as f64 + step_with;
        // Counted at its time, not weighted as the rest of the time to first token: weighted,
        // it kept long contexts on the decode workers holding them and raised ITL p99 (the
        // simulator's P/D suite, `crates/sim/README.md`).
        let transfer = s.transfer_ms(isl_tokens as f64 - held);
        let output = s.output_tokens.max(0.0);
        let decode = output * step_with + n * output * added_step;
        self.prefill_load_scale * ttft + transfer + decode + self.decode_active_request_weight * n
    }

    /// One decode step on the rank with this request added, and what it adds to the step.
    fn decode_steps(&self, c: &Candidate, bs: f64) -> (f64, f64) {
        let s = &c.speeds;
        let n = c.active_requests as f64;
        let kv_before = c.active_decode_blocks as f64 * bs;
        let kv_after = c.potential_decode_blocks as f64 * bs;
        let step_with = s.decode_step_ms(n + 1.0, kv_after);
        let added_step = (step_with - s.decode_step_ms(n, kv_before)).max(0.0);
        (step_with, added_step)
    }

    fn block_cost(&self, c: &Candidate, isl_tokens: u64, block_size: u32) -> f64 {
        let block_size = f64::from(block_size.max(1));
        let prefill_blocks = (c.active_prefill_tokens as f64 + isl_tokens as f64) / block_size;
        let credit = self.credit(c.device_blocks, c.host_blocks, c.disk_blocks);
        let adjusted = (prefill_blocks - credit).max(0.0);
        self.prefill_load_scale * adjusted
            + c.potential_decode_blocks as f64
            + self.decode_active_request_weight * c.active_requests as f64
    }

    /// The tokens this rank would compute for the prompt, as routing counts them: the engine's
    /// cached tokens by tier, times `overlap_score_credit`.
    pub fn routed_prefill_tokens(&self, c: &Candidate, isl_tokens: u64, block_size: u32) -> f64 {
        let cached = tier_credit(
            ENGINE_TIER_WEIGHTS,
            c.device_blocks,
            c.host_blocks,
            c.disk_blocks,
        ) * f64::from(block_size);
        (isl_tokens as f64 - self.overlap_score_credit * cached).max(0.0)
    }

    /// What the request's own prefill adds on this rank, the tolerance replicas spread within
    /// (`crate::selector::sync`): in blocks × `prefill_load_scale` under `dynamo`, in
    /// milliseconds under `kvroute`.
    pub fn own_prefill_cost(&self, c: &Candidate, isl_tokens: u64, block_size: u32) -> f64 {
        match self.profile {
            RouterProfile::Dynamo => {
                self.prefill_load_scale
                    * self.effective_prefill_tokens(
                        isl_tokens,
                        block_size,
                        c.device_blocks,
                        c.host_blocks,
                        c.disk_blocks,
                    ) as f64
                    / f64::from(block_size.max(1))
            }
            // Unweighted: the spread tolerates what one prefill of this prompt costs the rank.
            RouterProfile::Kvroute => {
                let u = self.routed_prefill_tokens(c, isl_tokens, block_size);
                c.speeds.prefill_ms(u.max(1.0))
            }
        }
    }

    fn time_cost(&self, c: &Candidate, isl_tokens: u64, block_size: u32) -> f64 {
        let s = &c.speeds;
        let bs = f64::from(block_size.max(1));
        let n = c.active_requests as f64;
        let output = s.output_tokens.max(0.0);
        // At least one token is computed even for a fully cached prompt.
        let own_prefill = s.prefill_ms(
            self.routed_prefill_tokens(c, isl_tokens, block_size)
                .max(1.0),
        );
        let ttft = s.prefill_ms_per_token * c.active_prefill_tokens as f64 + own_prefill;
        let stall = n * own_prefill;
        let (step_with, added_step) = self.decode_steps(c, bs);
        let decode = output * step_with + n * output * added_step;
        self.prefill_load_scale * ttft + stall + decode + self.decode_active_request_weight * n
    }

    /// Whether a rank is over one of the busy thresholds.
    pub fn is_busy(&self, c: &Candidate) -> bool {
        let decode_busy = match (self.busy_decode_fraction, c.total_kv_blocks) {
            (Some(f), Some(total)) if total > 0 => {
                c.active_decode_blocks as f64 >= f * total as f64
            }
            _ => false,
        };
        let prefill_busy_abs = self
            .busy_prefill_tokens
            .is_some_and(|limit| c.active_prefill_tokens >= limit);
        let prefill_busy_frac = match (self.busy_prefill_fraction, c.max_num_batched_tokens) {
            (Some(f), Some(max)) if max > 0 => c.active_prefill_tokens as f64 >= f * max as f64,
            _ => false,
        };
        decode_busy || prefill_busy_abs || prefill_busy_frac
    }
}

/// Tokens the engine will still have to prefill on a rank with this credit (in blocks):
/// `isl − floor(block_size × credit)`, clamped to `[0, isl]`.
pub fn effective_prefill_tokens(isl_tokens: u64, block_size: u32, credit: f64) -> u64 {
    let cached = (f64::from(block_size) * credit).floor();
    if !cached.is_finite() || cached <= 0.0 {
        return isl_tokens;
    }
    isl_tokens.saturating_sub(cached.min(u64::MAX as f64) as u64)
}

/// One eligible rank with what the cost function needs.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Candidate {
    pub rank: Rank,
    pub device_blocks: u32,
    pub host_blocks: u32,
    pub disk_blocks: u32,
    pub active_prefill_tokens: u64,
    pub active_decode_blocks: u64,
    pub potential_decode_blocks: u64,
    pub active_requests: u64,
    pub total_kv_blocks: Option<u64>,
    pub max_num_batched_tokens: Option<u64>,
    /// The engine speeds the `kvroute` cost uses (`crate::speed`).
    pub speeds: EngineSpeeds,
}

/// Picks an index into `costs`: the argmin with uniform tie-break at temperature 0, else a softmax
/// sample over min-max normalised costs. `costs` must not be empty.
pub fn pick(costs: &[f64], temperature: f64, rng: &mut impl Rng) -> usize {
    if costs.len() <= 1 {
        return 0;
    }
    if temperature > 0.0 && temperature.is_finite() {
        let min = costs.iter().copied().fold(f64::INFINITY, f64::min);
        let max = costs.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let span = max - min;
        if span > 0.0 && span.is_finite() {
            let weights: Vec<f64> = costs
                .iter()
                .map(|c| (-((c - min) / span) / temperature).exp())
                .collect();
            let total: f64 = weights.iter().sum();
            let mut target = rng.random::<f64>() * total;
            for (i, w) in weights.iter().enumerate() {
                if target < *w {
                    return i;
                }
                target -= w;
            }
            return costs.len() - 1;
        }
        // All costs equal: every rank is a tie.
    }
    let min = costs.iter().copied().fold(f64::INFINITY, f64::min);
    let ties = costs.iter().filter(|&&c| c == min).count();
    let k = tie_index(ties, rng);
    costs
        .iter()
        .enumerate()
        .filter(|&(_, &c)| c == min)
        .nth(k)
        .map_or(0, |(i, _)| i)
}

/// Which of `ties` equally cheap candidates (in candidate order) the lowest-cost pick takes:
/// uniform, one draw, and none for a single one. One draw whatever their number lets a select
/// that knows how many ranks tie without listing them (`selector/fleet.rs`) pick the same rank
/// from the same random source as the full scan.
pub fn tie_index(ties: usize, rng: &mut impl Rng) -> usize {
    if ties <= 1 {
        return 0;
    }
    rng.random_range(0..ties)
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;
    use rand::rngs::SmallRng;

    fn candidate(worker: u64, overlap: u32, decode: u64) -> Candidate {
        Candidate {
            rank: Rank::new(worker, 0),
            device_blocks: overlap,
            host_blocks: overlap,
            disk_blocks: overlap,
            active_prefill_tokens: 0,
            active_decode_blocks: 0,
            potential_decode_blocks: decode,
            active_requests: 0,
            total_kv_blocks: None,
            max_num_batched_tokens: None,
            speeds: EngineSpeeds::default(),
        }
    }

    #[test]
    fn documented_example_picks_the_second_rank() {
        // (prefill blocks, overlap, decode blocks) = (10, 2, 10), (10, 5, 5), (10, 8, 9), with
        // Dynamo's weights (SPEC §6).
        let config = SchedulerConfig::for_profile(RouterProfile::Dynamo);
        let candidates = [candidate(1, 2, 10), candidate(2, 5, 5), candidate(3, 8, 9)];
        let costs: Vec<f64> = candidates
            .iter()
            .map(|c| config.cost(c, 10 * 16, 16))
            .collect();
        assert_eq!(costs, vec![18.0, 10.0, 11.0]);
        let mut rng = SmallRng::seed_from_u64(1);
        assert_eq!(pick(&costs, 0.0, &mut rng), 1);
    }

    #[test]
    fn effective_prefill_follows_the_spec_examples() {
        let config = SchedulerConfig::for_profile(RouterProfile::Dynamo);
        // 18 tokens, block 4, 16 cached on the device → 2.
        assert_eq!(effective_prefill_tokens(18, 4, config.credit(4, 4, 4)), 2);
        // The same 16 only on the host: credit 0.75 × 4 blocks = 12 tokens → 18 − 12 = 6 (the
        // formula Dynamo applies, as its recorded 17-token example below confirms).
        assert_eq!(effective_prefill_tokens(18, 4, config.credit(0, 4, 4)), 6);
        // Dynamo's fixture: 2 blocks on GPU, 2 more on CPU, 17 tokens → 17 − ⌊4 × 3.5⌋ = 3.
        assert_eq!(effective_prefill_tokens(17, 4, config.credit(2, 4, 4)), 3);
        assert_eq!(effective_prefill_tokens(5, 4, 10.0), 0);
    }

    #[test]
    fn host_and_disk_extensions_are_credited_at_their_weights() {
        let config = SchedulerConfig::for_profile(RouterProfile::Dynamo);
        assert_eq!(config.credit(2, 4, 8), 2.0 + 0.75 * 2.0 + 0.25 * 4.0);
    }

    #[test]
    fn exact_ties_are_broken_uniformly() {
        let mut rng = SmallRng::seed_from_u64(42);
        let costs = [3.0, 1.0, 1.0, 1.0, 2.0];
        let mut hits = [0u32; 5];
        for _ in 0..3000 {
            hits[pick(&costs, 0.0, &mut rng)] += 1;
        }
        assert_eq!(hits[0] + hits[4], 0);
        for &h in &hits[1..4] {
            assert!((800..1200).contains(&h), "{hits:?}");
        }
    }

    #[test]
    fn temperature_prefers_cheap_ranks_but_samples_others() {
        let mut rng = SmallRng::seed_from_u64(7);
        let costs = [0.0, 10.0];
        let mut hits = [0u32; 2];
        for _ in 0..2000 {
            hits[pick(&costs, 1.0, &mut rng)] += 1;
        }
        // p(second) = e^-1 / (1 + e^-1) ≈ 0.269.
        assert!(hits[1] > 400 && hits[1] < 700, "{hits:?}");
    }

    #[test]
    fn overrides_replace_only_what_they_name() {
        let config = SchedulerConfig::default().with(&Overrides {
            overlap_score_credit: Some(0.0),
            ..Overrides::default()
        });
        assert_eq!(config.overlap_score_credit, 0.0);
        assert_eq!(config.prefill_load_scale, 32.0);
        assert_eq!(config.profile, RouterProfile::Kvroute);
    }

    #[test]
    fn profiles_have_their_weights_and_kvroute_is_the_default() {
        let kvroute = SchedulerConfig::for_profile(RouterProfile::Kvroute);
        let dynamo = SchedulerConfig::for_profile(RouterProfile::Dynamo);
        assert_eq!(SchedulerConfig::default(), kvroute);
        assert_eq!(
            (kvroute.overlap_score_credit, kvroute.prefill_load_scale),
            (1.0, 32.0)
        );
        assert_eq!(
            (dynamo.overlap_score_credit, dynamo.prefill_load_scale),
            (1.0, 1.0)
        );
        // Everything else is Dynamo's in both.
        assert_eq!(
            SchedulerConfig {
                profile: RouterProfile::Dynamo,
                prefill_load_scale: 1.0,
                ..kvroute
            },
            dynamo
        );
        for p in RouterProfile::ALL {
            assert_eq!(p.name().parse::<RouterProfile>(), Ok(p));
            assert_eq!(p.to_string(), p.name());
        }
        assert_eq!(
            "fast".parse::<RouterProfile>().unwrap_err(),
            "unknown router profile \"fast\" (known: kvroute, dynamo)"
        );
    }

    #[test]
    fn routing_weights_never_change_effective_prefill_under_the_kvroute_profile() {
        // 18 tokens, block 4, 16 on the device: 2 tokens to compute, whatever the credit.
        for credit in [0.0, 1.0, 3.0, 10.0] {
            let config = SchedulerConfig {
                overlap_score_credit: credit,
                host_cache_hit_weight: 2.0,
                disk_cache_hit_weight: 2.0,
                ..SchedulerConfig::default()
            };
            assert_eq!(config.effective_prefill_tokens(18, 4, 4, 4, 4), 2);
            // The same 16 only on the host: 0.75 × 16 = 12 cached → 6; only on disk → 18 − 4.
            assert_eq!(config.effective_prefill_tokens(18, 4, 0, 4, 4), 6);
            assert_eq!(config.effective_prefill_tokens(18, 4, 0, 0, 4), 14);
        }
        // Dynamo's formula lets the credit in: 3 × 4 blocks × 4 tokens ≥ 18 → 0.
        let dynamo = SchedulerConfig {
            overlap_score_credit: 3.0,
            ..SchedulerConfig::for_profile(RouterProfile::Dynamo)
        };
        assert_eq!(dynamo.effective_prefill_tokens(18, 4, 4, 4, 4), 0);
        assert_eq!(
            SchedulerConfig::for_profile(RouterProfile::Dynamo)
                .effective_prefill_tokens(18, 4, 4, 4, 4),
            2
        );
    }

    /// A rank holding `held` of a 4,864-token prompt (block 64) with `running` requests of
    /// `context` tokens each.
    fn loaded(worker: u64, held_tokens: u32, running: u64, context: u64) -> Candidate {
        let blocks = held_tokens / 64;
        let kv_blocks = running * context / 64;
        Candidate {
            active_decode_blocks: kv_blocks,
            potential_decode_blocks: kv_blocks + (4864 / 64 - u64::from(blocks)),
            active_requests: running,
            ..candidate(worker, blocks, 0)
        }
    }

    #[test]
    fn a_holder_wins_until_its_running_batch_outweighs_the_prefix() {
        let config = SchedulerConfig::default();
        let cost = |c: &Candidate| config.cost(c, 4864, 64);
        let idle = loaded(2, 0, 0, 0);
        // Holding the 4,096-token system prompt with a few requests running: the holder.
        assert!(cost(&loaded(1, 4096, 2, 5000)) < cost(&idle));
        // The holder's batch grows; at some size the idle rank wins, and stays the winner.
        let crossover = (0..200u64)
            .find(|&n| cost(&loaded(1, 4096, n, 5000)) > cost(&idle))
            .expect("a large enough batch loses to an idle rank");
        assert!((3..100).contains(&crossover), "crossover at {crossover}");
        for n in crossover..crossover + 50 {
            assert!(cost(&loaded(1, 4096, n, 5000)) > cost(&idle), "{n}");
        }
        // A longer cached prefix is worth a larger batch.
        let long = |n: u64| {
            let mut c = loaded(1, 4096, n, 5000);
            c.device_blocks = 4800 / 64;
            c.host_blocks = c.device_blocks;
            c.disk_blocks = c.device_blocks;
            c
        };
        let long_crossover = (0..400u64).find(|&n| cost(&long(n)) > cost(&idle));
        assert!(
            long_crossover.is_none_or(|n| n >= crossover),
            "{long_crossover:?}"
        );
        // Queued prefill on the holder counts at the request's own weight.
        let mut queued = loaded(1, 4096, 2, 5000);
        queued.active_prefill_tokens = 50_000;
        assert!(cost(&queued) > cost(&idle));
    }

    #[test]
    fn slower_engines_and_longer_outputs_shift_the_balance_towards_load() {
        let config = SchedulerConfig::default();
        let holder = loaded(1, 4096, 12, 5000);
        let idle = loaded(2, 0, 0, 0);
        let margin = |speeds: EngineSpeeds| {
            let (mut h, mut i) = (holder, idle);
            h.speeds = speeds;
            i.speeds = speeds;
            config.cost(&h, 4864, 64) - config.cost(&i, 4864, 64)
        };
        let prior = EngineSpeeds::default();
        // A decode step that grows faster with the batch, or longer outputs, make joining the
        // holder's batch dearer; a slower prefill makes the cached prefix worth more.
        let heavy_decode = EngineSpeeds {
            decode_ms_per_request: prior.decode_ms_per_request * 10.0,
            ..prior
        };
        let long_outputs = EngineSpeeds {
            output_tokens: prior.output_tokens * 4.0,
            ..prior
        };
        let slow_prefill = EngineSpeeds {
            prefill_ms_per_token: prior.prefill_ms_per_token * 4.0,
            ..prior
        };
        assert!(margin(heavy_decode) > margin(prior));
        assert!(margin(long_outputs) > margin(prior));
        assert!(margin(slow_prefill) < margin(prior));
    }

    #[test]
    fn the_dynamo_profile_keeps_its_block_cost() {
        // Speeds change nothing under Dynamo's profile.
        let config = SchedulerConfig::for_profile(RouterProfile::Dynamo);
        let mut c = candidate(1, 2, 10);
        let before = config.cost(&c, 10 * 16, 16);
        c.speeds.prefill_ms_per_token *= 10.0;
        c.speeds.output_tokens = 10_000.0;
        assert_eq!(config.cost(&c, 10 * 16, 16), before);
        assert_eq!(before, 18.0);
    }

    #[test]
    fn busy_thresholds() {
        let config = SchedulerConfig {
            busy_decode_fraction: Some(0.5),
            busy_prefill_tokens: Some(1000),
            ..SchedulerConfig::default()
        };
        let mut c = candidate(1, 0, 0);
        c.total_kv_blocks = Some(100);
        c.active_decode_blocks = 49;
        assert!(!config.is_busy(&c));
        c.active_decode_blocks = 50;
        assert!(config.is_busy(&c));
        c.active_decode_blocks = 0;
        c.active_prefill_tokens = 1000;
        assert!(config.is_busy(&c));
    }
}
