//! Engine speeds for the `kvroute` profile's cost in predicted time (`crate::schedule`): what a
//! prefill token, a prefill step and a decode step take on a rank, learned online from the
//! lifecycle calls the load tracker already sees, starting from a prior.
//!
//! The model, per rank (milliseconds):
//! ```text
//! prefill(x)    = prefill_overhead + prefill_per_token × x        x = tokens the engine computes
//! decode_step   = decode_base + decode_per_request × n + decode_per_ktoken × kv_ktokens
//! ```
//! where `n` is the requests running on the rank and `kv_ktokens` the thousands of tokens its live
//! bookings hold in KV. What is learned, and from what:
//! - **prefill per token**, fleet-wide: a booking's select → `prefill_complete` interval is the
//!   prefill queued ahead of it plus its own, so `(interval − overhead) ÷ (tokens ahead + own)`
//!   is one sample. Not per rank: a rank's samples carry its own queueing, so a rank that was
//!   busy would look slow, be avoided, and — receiving nothing — keep looking slow (measured:
//!   per-rank estimates failed more cells of the simulator's suite, `crates/sim/README.md`).
//! - **the decode step**, fleet-wide: the interval between two `output_block` calls of one
//!   booking is one block of decode steps; with the rank's `n` and KV tokens at that moment it is
//!   one sample of a linear regression, regularised towards the prior (ridge) so that a few
//!   samples move it a little and many move it all the way.
//! - **output length**: the output blocks a booking reported by its `free`.
//!
//! Every sample is clamped to within [`OUTLIER_FACTOR`] of the current estimate before it counts,
//! and old samples fade (each estimate averages roughly its last [`WINDOW`] samples), so a stalled
//! client, a lost `prefill_complete` or an engine restart moves an estimate by a bounded step.
//! The overhead and the intercept of the prior are not learned from TTFT (they cannot be told
//! apart from queueing there); the decode regression learns its own intercept.
//!
//! Sans-io: intervals come in as [`Duration`]s computed by the caller from its `now` arguments.

use std::time::Duration;

/// A sample further than this factor from the current estimate counts as this factor.
pub const OUTLIER_FACTOR: f64 = 3.0;
/// Roughly how many recent samples an estimate averages.
pub const WINDOW: f64 = 64.0;
/// How many samples the prior is worth.
const PRIOR_WEIGHT: f64 = 8.0;
/// Prefill samples of fewer tokens than this say more about queueing noise than speed.
const MIN_PREFILL_SAMPLE_TOKENS: u64 = 64;

/// An engine's speeds: what the cost in predicted time assumes (see the module documentation).
///
/// The default is the prior, what an engine is assumed to do before anything was measured: vLLM
/// serving an 8B-class model on one H100-class GPU, the step-time fit Dynamo's mocker engine uses
/// (prefill ≈ 16.5 ms + 15.2 µs a token; decode ≈ 5.7 ms growing with KV usage, ≈ 54 ms over a
/// full 16,384 × 64-token pool, i.e. ≈ 0.05 ms per thousand KV tokens), a small per-sequence
/// decode cost, and 256 output tokens a request.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct EngineSpeeds {
    pub prefill_overhead_ms: f64,
    pub prefill_ms_per_token: f64,
    pub decode_base_ms: f64,
    pub decode_ms_per_request: f64,
    pub decode_ms_per_ktoken: f64,
    /// Output tokens of a request: in a prior, the mean assumed; in the speeds a cost uses, the
    /// request's own `expected_output_tokens`, else the mean measured, else the prior's.
    pub output_tokens: f64,
    /// Milliseconds to move one token's KV from a prefill worker to a decode worker in a
    /// disaggregated fleet. The prior: an 8B-class model's 128 KiB of KV a token over a
    /// 25 GB/s RDMA link, ≈ 5 µs. Not learned.
    pub kv_transfer_ms_per_token: f64,
}

impl Default for EngineSpeeds {
    fn default() -> Self {
        Self {
            prefill_overhead_ms: 16.5,
            prefill_ms_per_token: 0.0152,
            decode_base_ms: 5.74,
            decode_ms_per_request: 0.02,
            decode_ms_per_ktoken: 0.0515,
            output_tokens: 256.0,
            kv_transfer_ms_per_token: 0.005,
        }
    }
}

impl EngineSpeeds {
    /// Milliseconds of one prefill of `tokens` computed tokens (0 computes nothing).
    pub fn prefill_ms(&self, tokens: f64) -> f64 {
        if tokens <= 0.0 {
            return 0.0;
        }
        self.prefill_overhead_ms + self.prefill_ms_per_token * tokens
    }

    /// Milliseconds to move `tokens` tokens' KV between workers.
    pub fn transfer_ms(&self, tokens: f64) -> f64 {
        self.kv_transfer_ms_per_token * tokens.max(0.0)
    }

    /// Milliseconds of one decode step with `requests` running and `kv_tokens` held.
    pub fn decode_step_ms(&self, requests: f64, kv_tokens: f64) -> f64 {
        self.decode_base_ms
            + self.decode_ms_per_request * requests
            + self.decode_ms_per_ktoken * kv_tokens / 1000.0
    }
}

/// A fading mean with a prior: `(prior × PRIOR_WEIGHT + Σ samples) ÷ (PRIOR_WEIGHT + n)`, where
/// each new sample multiplies the older ones' weight by `1 − 1 / WINDOW`.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
struct FadingMean {
    sum: f64,
    weight: f64,
}

impl FadingMean {
    fn value(&self, prior: f64) -> f64 {
        (prior * PRIOR_WEIGHT + self.sum) / (PRIOR_WEIGHT + self.weight)
    }

    fn observe(&mut self, sample: f64, prior: f64) {
        if !sample.is_finite() || sample < 0.0 {
            return;
        }
        let current = self.value(prior);
        let sample = sample.clamp(current / OUTLIER_FACTOR, current * OUTLIER_FACTOR);
        let fade = 1.0 - 1.0 / WINDOW;
        self.sum = self.sum * fade + sample;
        self.weight = self.weight * fade + 1.0;
    }
}

/// Ridge regression of the decode step on `[1, requests, kv_ktokens]`, regularised towards the
/// prior's coefficients, with fading sufficient statistics.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
struct DecodeFit {
    xtx: [[f64; 3]; 3],
    xty: [f64; 3],
    /// The solved coefficients, `None` until the first sample.
    solved: Option<[f64; 3]>,
}

/// Typical feature sizes: they scale the prior's precision so that it is worth
/// `PRIOR_WEIGHT` samples of a typical rank on every coefficient.
const TYPICAL_REQUESTS: f64 = 16.0;
const TYPICAL_KTOKENS: f64 = 64.0;

impl DecodeFit {
    fn coefficients(&self, prior: &EngineSpeeds) -> [f64; 3] {
        self.solved.unwrap_or([
            prior.decode_base_ms,
            prior.decode_ms_per_request,
            prior.decode_ms_per_ktoken,
        ])
    }

    fn observe(&mut self, requests: f64, kv_ktokens: f64, step_ms: f64, prior: &EngineSpeeds) {
        if !(step_ms.is_finite() && step_ms > 0.0 && requests >= 0.0 && kv_ktokens >= 0.0) {
            return;
        }
        let x = [1.0, requests, kv_ktokens];
        let c = self.coefficients(prior);
        let predicted = (c[0] + c[1] * requests + c[2] * kv_ktokens).max(1e-3);
        let y = step_ms.clamp(predicted / OUTLIER_FACTOR, predicted * OUTLIER_FACTOR);
        let fade = 1.0 - 1.0 / WINDOW;
        for i in 0..3 {
            for j in 0..3 {
                self.xtx[i][j] = self.xtx[i][j] * fade + x[i] * x[j];
            }
            self.xty[i] = self.xty[i] * fade + x[i] * y;
        }
        let theta0 = [
            prior.decode_base_ms,
            prior.decode_ms_per_request,
            prior.decode_ms_per_ktoken,
        ];
        let lambda = [
            PRIOR_WEIGHT,
            PRIOR_WEIGHT * TYPICAL_REQUESTS * TYPICAL_REQUESTS,
            PRIOR_WEIGHT * TYPICAL_KTOKENS * TYPICAL_KTOKENS,
        ];
        let mut a = self.xtx;
        let mut b = self.xty;
        for i in 0..3 {
            a[i][i] += lambda[i];
            b[i] += lambda[i] * theta0[i];
        }
        if let Some(mut theta) = solve3(a, b) {
            // A step never gets faster with more work: negative slopes are noise.
            theta[1] = theta[1].max(0.0);
            theta[2] = theta[2].max(0.0);
            theta[0] = theta[0].max(0.0);
            self.solved = Some(theta);
        }
    }
}

/// Solves the 3×3 system `a θ = b` by Gaussian elimination with partial pivoting; `None` when
/// it is singular (cannot happen with the ridge term, but the arithmetic is checked anyway).
fn solve3(mut a: [[f64; 3]; 3], mut b: [f64; 3]) -> Option<[f64; 3]> {
    for col in 0..3 {
        let pivot = (col..3).max_by(|&i, &j| a[i][col].abs().total_cmp(&a[j][col].abs()))?;
        if a[pivot][col].abs() < 1e-12 {
            return None;
        }
        a.swap(col, pivot);
        b.swap(col, pivot);
        let pivot_row = a[col];
        for row in col + 1..3 {
            let f = a[row][col] / pivot_row[col];
            for (k, v) in a[row].iter_mut().enumerate().skip(col) {
                *v -= f * pivot_row[k];
            }
            b[row] -= f * b[col];
        }
    }
    let mut x = [0.0; 3];
    for row in (0..3).rev() {
        let tail: f64 = (row + 1..3).map(|k| a[row][k] * x[k]).sum();
        x[row] = (b[row] - tail) / a[row][row];
    }
    x.iter().all(|v| v.is_finite()).then_some(x)
}

/// What has been measured (see the module documentation). Lives in the load tracker, which sees
/// every lifecycle call.
#[derive(Debug, Clone, Default)]
pub struct Calibration {
    prefill: FadingMean,
    decode: DecodeFit,
    output_tokens: FadingMean,
    samples: CalibrationSamples,
}

/// How many samples of each kind were taken (for `/loads` and tests).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CalibrationSamples {
    pub prefill: u64,
    pub decode: u64,
    pub output: u64,
}

impl Calibration {
    pub fn new() -> Self {
        Self::default()
    }

    /// A booking's prefill completed `elapsed` after it was booked, with `tokens_ahead` prefill
    /// tokens queued before it on its rank and `own_tokens` of its own to compute.
    pub fn observe_prefill(
        &mut self,
        tokens_ahead: u64,
        own_tokens: u64,
        elapsed: Duration,
        prior: &EngineSpeeds,
    ) {
        let tokens = tokens_ahead.saturating_add(own_tokens);
        if tokens < MIN_PREFILL_SAMPLE_TOKENS {
            return;
        }
        let ms = elapsed.as_secs_f64() * 1e3;
        let per_token = (ms - prior.prefill_overhead_ms).max(0.0) / tokens as f64;
        self.prefill.observe(per_token, prior.prefill_ms_per_token);
        self.samples.prefill += 1;
    }

    /// One block of `block_size` decode steps took `elapsed` on a rank with `requests` running
    /// and `kv_tokens` held.
    pub fn observe_decode_block(
        &mut self,
        requests: u64,
        kv_tokens: u64,
        block_size: u32,
        elapsed: Duration,
        prior: &EngineSpeeds,
    ) {
        if block_size == 0 {
            return;
        }
        let step_ms = elapsed.as_secs_f64() * 1e3 / f64::from(block_size);
        self.decode
            .observe(requests as f64, kv_tokens as f64 / 1000.0, step_ms, prior);
        self.samples.decode += 1;
    }

    /// A booking ended having produced about `output_tokens`.
    pub fn observe_output(&mut self, output_tokens: u64, prior: &EngineSpeeds) {
        self.output_tokens
            .observe(output_tokens as f64, prior.output_tokens);
        self.samples.output += 1;
    }

    /// The speeds now; `expected_output_tokens` is the request's own, when it sent one.
    pub fn speeds(
        &self,
        expected_output_tokens: Option<u64>,
        prior: &EngineSpeeds,
    ) -> EngineSpeeds {
        let [base, per_request, per_ktoken] = self.decode.coefficients(prior);
        EngineSpeeds {
            prefill_overhead_ms: prior.prefill_overhead_ms,
            prefill_ms_per_token: self.prefill.value(prior.prefill_ms_per_token),
            decode_base_ms: base,
            decode_ms_per_request: per_request,
            decode_ms_per_ktoken: per_ktoken,
            output_tokens: expected_output_tokens
                .map(|t| t as f64)
                .unwrap_or_else(|| self.output_tokens.value(prior.output_tokens)),
            kv_transfer_ms_per_token: prior.kv_transfer_ms_per_token,
        }
    }

    /// The samples taken so far.
    pub fn samples(&self) -> CalibrationSamples {
        self.samples
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(v: f64) -> Duration {
        Duration::from_secs_f64(v / 1e3)
    }

    #[test]
    fn nothing_measured_is_the_prior() {
        let prior = EngineSpeeds::default();
        let s = Calibration::new().speeds(None, &prior);
        assert_eq!(s, prior);
        assert_eq!(
            Calibration::new().speeds(Some(40), &prior).output_tokens,
            40.0
        );
    }

    /// A scripted engine twice as slow as the prior, with 20 % noise: every estimate converges.
    #[test]
    fn calibration_converges_on_a_scripted_engine() {
        let prior = EngineSpeeds::default();
        let mut cal = Calibration::new();
        let true_per_token = 2.0 * prior.prefill_ms_per_token;
        let (base, per_req, per_kt) = (9.0, 0.15, 0.2);
        let mut noise = 0.8;
        for i in 0..2000u64 {
            noise = if noise > 1.15 { 0.8 } else { noise + 0.037 };
            let ahead = (i * 977) % 20_000;
            let own = 500 + (i * 131) % 4000;
            let ttft = prior.prefill_overhead_ms + true_per_token * (ahead + own) as f64 * noise;
            cal.observe_prefill(ahead, own, ms(ttft), &prior);
            let n = 1 + (i * 7) % 48;
            let kv = 1000 + (i * 7919) % 200_000;
            let step = (base + per_req * n as f64 + per_kt * kv as f64 / 1000.0) * noise;
            cal.observe_decode_block(n, kv, 16, ms(step * 16.0), &prior);
            cal.observe_output(100 + (i % 3) * 100, &prior);
        }
        let s = cal.speeds(None, &prior);
        let close = |got: f64, want: f64, tol: f64| (got - want).abs() <= tol * want;
        assert!(close(s.prefill_ms_per_token, true_per_token, 0.1), "{s:?}");
        // The ridge prior and the fading window leave the decode fit within a third.
        assert!(close(s.decode_base_ms, base, 0.3), "{s:?}");
        assert!(close(s.decode_ms_per_request, per_req, 0.35), "{s:?}");
        assert!(close(s.decode_ms_per_ktoken, per_kt, 0.2), "{s:?}");
        // Far from the prior (0.02 ms a request, 0.05 a thousand tokens): it learned.
        let prior_step = prior.decode_step_ms(32.0, 100_000.0);
        let true_step = base + per_req * 32.0 + per_kt * 100.0;
        assert!(
            close(s.decode_step_ms(32.0, 100_000.0), true_step, 0.1),
            "{prior_step}"
        );
        assert!(close(s.output_tokens, 200.0, 0.1), "{s:?}");
        assert_eq!(cal.samples().prefill, 2000);
    }

    #[test]
    fn outliers_move_an_estimate_by_a_bounded_step() {
        let prior = EngineSpeeds::default();
        let mut cal = Calibration::new();
        for _ in 0..300 {
            let ttft = prior.prefill_overhead_ms + prior.prefill_ms_per_token * 4000.0;
            cal.observe_prefill(0, 4000, ms(ttft), &prior);
            cal.observe_decode_block(8, 50_000, 16, ms(16.0 * 8.0), &prior);
        }
        let before = cal.speeds(None, &prior);
        // A client that reported prefill_complete an hour late, a stalled stream, garbage.
        cal.observe_prefill(0, 4000, Duration::from_secs(3600), &prior);
        cal.observe_decode_block(8, 50_000, 16, Duration::from_secs(600), &prior);
        cal.observe_decode_block(8, 50_000, 16, Duration::ZERO, &prior);
        cal.observe_output(u64::MAX, &prior);
        let after = cal.speeds(None, &prior);
        let moved = |a: f64, b: f64| (a - b).abs() / b;
        assert!(moved(after.prefill_ms_per_token, before.prefill_ms_per_token) < 0.05);
        let step = |s: &EngineSpeeds| s.decode_step_ms(8.0, 50_000.0);
        assert!(
            moved(step(&after), step(&before)) < 0.1,
            "{before:?} {after:?}"
        );
        assert!(after.output_tokens < 3.0 * prior.output_tokens);
        // Tiny prefills (a fully cached prompt) teach nothing.
        let mut fresh = Calibration::new();
        fresh.observe_prefill(0, 10, Duration::from_secs(5), &prior);
        assert_eq!(fresh.samples().prefill, 0);
    }

    #[test]
    fn solve3_solves_and_refuses_singular_systems() {
        let a = [[2.0, 1.0, 0.0], [1.0, 3.0, 1.0], [0.0, 1.0, 4.0]];
        let x = solve3(a, [3.0, 5.0, 5.0]).unwrap();
        for (got, want) in x.iter().zip([1.0, 1.0, 1.0]) {
            assert!((got - want).abs() < 1e-9);
        }
        assert_eq!(solve3([[1.0, 2.0, 3.0]; 3], [1.0; 3]), None);
    }
}
