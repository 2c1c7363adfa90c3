//! How long one engine step takes (virtual time).
//!
//! A step runs the prefill chunks and the decode tokens its scheduler picked:
//! ```text
//! prefill_ms(T) = a·T² + b·T + c        T = uncached (computed) prompt tokens in the step
//! decode_ms     = fitted: max(min, d·u² + e·u + f)   u = fraction of the KV pool's blocks in use
//!                 batch:  base + per_seq·S + per_token·C   S = decoding sequences, C = their context
//! step_ms       = (prefill_ms(T) if T > 0) + (decode_ms if the step decodes), / speedup
//! ```
//! The default (`fitted`) coefficients are the ones Dynamo's mocker engine was fitted with (a vLLM
//! engine on one GPU), so simulated latencies have a realistic shape; they are all flags of
//! `kvroute sim`. The fitted decode depends only on how full the pool is, so a worker with a large
//! idle cache decodes as slowly as a busy one. The `batch` model ([`BatchDecode`]) is the
//! memory-bound shape of a real decode step instead: read the weights once, then every decoding
//! sequence's KV, so a step grows with the batch and its context. Judging a policy under both keeps
//! it from being fitted to one simulator.

use crate::SimError;

/// Nanoseconds of virtual time.
pub type Nanos = u64;

/// Which decode-step model an engine uses (`--engine-model`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum EngineModel {
    /// `d·u² + e·u + f` at KV usage `u` ([`TimingModel::decode_coefficients`]).
    Fitted,
    /// Grows with the decoding sequences and their context ([`BatchDecode`]).
    Batch(BatchDecode),
}

impl EngineModel {
    /// `fitted` or `batch` (the latter with [`BatchDecode::default`]).
    pub fn parse(text: &str) -> Result<Self, SimError> {
        match text.trim() {
            "fitted" => Ok(Self::Fitted),
            "batch" => Ok(Self::Batch(BatchDecode::default())),
            other => Err(SimError::invalid(
                "engine-model",
                format!("expected `fitted` or `batch`, got `{other}`"),
            )),
        }
    }

    /// `fitted` or `batch`.
    pub fn name(&self) -> &'static str {
        match self {
            Self::Fitted => "fitted",
            Self::Batch(_) => "batch",
        }
    }
}

/// A decode step that reads the weights once and then every decoding sequence's KV:
/// `base_ms + per_sequence_ms·S + per_context_token_ms·C` for `S` sequences holding `C` tokens.
///
/// The defaults describe vLLM serving an 8B model (Llama-3.1-8B: 32 layers, 8 KV heads of 128
/// dimensions) on one H100 SXM (3.35 TB/s of HBM):
/// - `base_ms` 6.5: the 16 GB of bf16 weights read once per step take ~4.8 ms at peak bandwidth,
///   plus kernel launch and scheduler overhead (vLLM's reported ~6–8 ms inter-token latency at
///   batch 1 for 8B models on H100).
/// - `per_context_token_ms` 2.6e-5: an fp8 KV cache holds 2 × 32 × 8 × 128 bytes = 64 KiB per
///   token, read at ~2.5 TB/s (~75 % of peak), 26 ns a token. A batch of 64 sequences of 4,096
///   tokens then adds ~6.8 ms, about doubling the step. (The default pool, 16,384 blocks of 64
///   tokens at 64 KiB, is 64 GiB: what is left of 80 GB beside the weights.)
/// - `per_sequence_ms` 0.03: sampling and per-sequence bookkeeping, ~2 ms at a batch of 64.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BatchDecode {
    pub base_ms: f64,
    pub per_sequence_ms: f64,
    pub per_context_token_ms: f64,
}

impl Default for BatchDecode {
    fn default() -> Self {
        Self {
            base_ms: 6.5,
            per_sequence_ms: 0.03,
            per_context_token_ms: 2.6e-5,
        }
    }
}

/// The sequences a step decodes (one token each) and the tokens of context they hold.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct DecodeBatch {
    pub sequences: u64,
    pub context_tokens: u64,
}

/// Coefficients of the step-time model. See the module documentation.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TimingModel {
    /// Prefill `[a, b, c]`: `a·T² + b·T + c` milliseconds for `T` uncached tokens.
    pub prefill_coefficients: [f64; 3],
    /// Decode `[d, e, f]`: `d·u² + e·u + f` milliseconds at KV usage `u ∈ [0, 1]`.
    pub decode_coefficients: [f64; 3],
    /// Floor of a decode step, milliseconds.
    pub decode_min_ms: f64,
    /// Every step's duration is divided by this (a faster or slower engine).
    pub speedup: f64,
    /// The decode model: the fitted curve above or the batch model.
    pub engine_model: EngineModel,
}

impl Default for TimingModel {
    fn default() -> Self {
        Self {
            prefill_coefficients: [4.209989e-7, 1.518344e-2, 16.50142],
            decode_coefficients: [-25.74, 54.01, 5.74],
            decode_min_ms: 1.0,
            speedup: 1.0,
            engine_model: EngineModel::Fitted,
        }
    }
}

impl TimingModel {
    /// Checks that every coefficient is finite and the speed-up is positive.
    pub fn validate(&self) -> Result<(), SimError> {
        let finite = self
            .prefill_coefficients
            .iter()
            .chain(&self.decode_coefficients)
            .chain([&self.decode_min_ms])
            .all(|c| c.is_finite());
        let batch_ok = match self.engine_model {
            EngineModel::Fitted => true,
            EngineModel::Batch(b) => [b.base_ms, b.per_sequence_ms, b.per_context_token_ms]
                .iter()
                .all(|c| c.is_finite() && *c >= 0.0),
        };
        if !batch_ok {
            return Err(SimError::invalid(
                "batch-decode-coefficients",
                "every coefficient must be a finite number ≥ 0",
            ));
        }
        if !finite {
            return Err(SimError::invalid(
                "timing coefficients",
                "every coefficient must be a finite number",
            ));
        }
        if !(self.speedup.is_finite() && self.speedup > 0.0) {
            return Err(SimError::invalid(
                "speedup",
                format!("must be a positive number, got {}", self.speedup),
            ));
        }
        Ok(())
    }

    /// Prefill milliseconds for `uncached_tokens` computed in one step (before the speed-up).
    pub fn prefill_ms(&self, uncached_tokens: u64) -> f64 {
        let [a, b, c] = self.prefill_coefficients;
        let t = uncached_tokens as f64;
        (a * t * t + b * t + c).max(0.0)
    }

    /// Decode milliseconds at KV usage `usage` (clamped to `[0, 1]`; before the speed-up).
    pub fn decode_ms(&self, usage: f64) -> f64 {
        let [d, e, f] = self.decode_coefficients;
        let u = if usage.is_finite() {
            usage.clamp(0.0, 1.0)
        } else {
            1.0
        };
        (d * u * u + e * u + f).max(self.decode_min_ms)
    }

    /// Decode milliseconds of one step of the engine model (before the speed-up): the fitted
    /// curve at KV usage `usage`, or the batch model for `batch`.
    pub fn decode_step_ms(&self, batch: DecodeBatch, usage: f64) -> f64 {
        match self.engine_model {
            EngineModel::Fitted => self.decode_ms(usage),
            EngineModel::Batch(b) => (b.base_ms
                + b.per_sequence_ms * batch.sequences as f64
                + b.per_context_token_ms * batch.context_tokens as f64)
                .max(self.decode_min_ms),
        }
    }

    /// Duration of one step, in nanoseconds of virtual time (at least 1 ns, so time advances):
    /// `prefill_tokens` uncached tokens computed, `decode` the sequences decoding (none: a
    /// prefill-only step), at KV usage `usage`.
    pub fn step_nanos(&self, prefill_tokens: u64, decode: DecodeBatch, usage: f64) -> Nanos {
        let mut ms = 0.0;
        if prefill_tokens > 0 {
            ms += self.prefill_ms(prefill_tokens);
        }
        if decode.sequences > 0 {
            ms += self.decode_step_ms(decode, usage);
        }
        let nanos = (ms * 1e6 / self.speedup).round();
        if nanos.is_finite() && nanos >= 1.0 {
            // Saturating float-to-int conversion: a (nonsensical) step of > 584 years is capped.
            nanos as Nanos
        } else {
            1
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefill_follows_the_fitted_quadratic() {
        let m = TimingModel::default();
        assert!((m.prefill_ms(0) - 16.50142).abs() < 1e-9);
        // 8,192 tokens: 4.209989e-7·8192² + 1.518344e-2·8192 + 16.50142.
        let expected = 4.209989e-7 * 8192.0 * 8192.0 + 1.518344e-2 * 8192.0 + 16.50142;
        assert!((m.prefill_ms(8192) - expected).abs() < 1e-9);
        assert!((m.prefill_ms(8192) - 169.137).abs() < 1e-3);
    }

    #[test]
    fn decode_is_a_concave_curve_with_a_floor() {
        let m = TimingModel::default();
        assert!((m.decode_ms(0.0) - 5.74).abs() < 1e-12);
        assert!((m.decode_ms(1.0) - (-25.74 + 54.01 + 5.74)).abs() < 1e-9);
        assert!((m.decode_ms(0.5) - (-25.74 * 0.25 + 54.01 * 0.5 + 5.74)).abs() < 1e-9);
        // Out-of-range usage is clamped.
        assert_eq!(m.decode_ms(7.0), m.decode_ms(1.0));
        assert_eq!(m.decode_ms(-1.0), m.decode_ms(0.0));
        let floored = TimingModel {
            decode_coefficients: [0.0, 0.0, 0.1],
            ..m
        };
        assert_eq!(floored.decode_ms(0.3), 1.0);
    }

    fn decoding(sequences: u64, context_tokens: u64) -> DecodeBatch {
        DecodeBatch {
            sequences,
            context_tokens,
        }
    }

    #[test]
    fn step_adds_both_phases_and_divides_by_the_speedup() {
        let m = TimingModel::default();
        let both = m.prefill_ms(1000) + m.decode_ms(0.25);
        assert_eq!(
            m.step_nanos(1000, decoding(1, 10), 0.25),
            (both * 1e6).round() as u64
        );
        assert_eq!(
            m.step_nanos(0, decoding(3, 99), 0.0),
            (5.74f64 * 1e6).round() as u64,
            "a decode-only step"
        );
        let fast = TimingModel { speedup: 4.0, ..m };
        assert_eq!(
            fast.step_nanos(1000, decoding(1, 10), 0.25),
            (both * 1e6 / 4.0).round() as u64
        );
        assert_eq!(
            m.step_nanos(0, DecodeBatch::default(), 0.0),
            1,
            "an empty step still advances time"
        );
    }

    #[test]
    fn batch_decode_grows_with_sequences_and_context() {
        let m = TimingModel {
            engine_model: EngineModel::Batch(BatchDecode::default()),
            ..TimingModel::default()
        };
        let one = m.decode_step_ms(decoding(1, 1_000), 0.5);
        let more_sequences = m.decode_step_ms(decoding(8, 1_000), 0.5);
        let more_context = m.decode_step_ms(decoding(1, 100_000), 0.5);
        assert!(more_sequences > one, "{more_sequences} vs {one}");
        assert!(more_context > one, "{more_context} vs {one}");
        // KV usage does not matter to the batch model, only to the fitted one.
        assert_eq!(one, m.decode_step_ms(decoding(1, 1_000), 0.0));
        let fitted = TimingModel::default();
        assert!(
            fitted.decode_step_ms(decoding(1, 1), 0.9)
                > fitted.decode_step_ms(decoding(64, 1 << 20), 0.1)
        );
        // The calibration point: 64 sequences of 4,096 tokens about double the smallest step.
        let base = m.decode_step_ms(decoding(1, 1), 0.0);
        let big = m.decode_step_ms(decoding(64, 64 * 4096), 0.0);
        assert!((1.8..2.6).contains(&(big / base)), "{big} / {base}");
        let d = BatchDecode::default();
        let expected = d.base_ms + d.per_sequence_ms * 64.0 + d.per_context_token_ms * 262_144.0;
        assert!((big - expected).abs() < 1e-9);
        assert_eq!(
            m.step_nanos(0, decoding(64, 64 * 4096), 0.0),
            (expected * 1e6).round() as u64
        );
    }

    #[test]
    fn engine_models_parse_by_name() {
        assert_eq!(EngineModel::parse("fitted").unwrap(), EngineModel::Fitted);
        let batch = EngineModel::parse("batch").unwrap();
        assert_eq!(batch.name(), "batch");
        let err = EngineModel::parse("gpu").unwrap_err().to_string();
        assert!(err.contains("engine-model") && err.contains("gpu"), "{err}");
        let bad = TimingModel {
            engine_model: EngineModel::Batch(BatchDecode {
                base_ms: f64::NAN,
                ..BatchDecode::default()
            }),
            ..TimingModel::default()
        };
        assert!(bad.validate().is_err());
    }

    #[test]
    fn validation_names_the_knob() {
        let bad = TimingModel {
            speedup: 0.0,
            ..TimingModel::default()
        };
        assert!(bad.validate().unwrap_err().to_string().contains("speedup"));
        let nan = TimingModel {
            prefill_coefficients: [f64::NAN, 0.0, 0.0],
            ..TimingModel::default()
        };
        assert!(nan.validate().is_err());
        assert!(TimingModel::default().validate().is_ok());
    }
}
