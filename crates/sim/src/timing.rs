//! How long one engine step takes (virtual time).
//!
//! A step runs the prefill chunks and the decode tokens its scheduler picked:
//! ```text
//! prefill_ms(T) = a·T² + b·T + c        T = uncached (computed) prompt tokens in the step
//! decode_ms(u)  = max(min, d·u² + e·u + f)   u = fraction of the KV pool's blocks in use
//! step_ms       = (prefill_ms(T) if T > 0) + (decode_ms(u) if the step decodes), / speedup
//! ```
//! The default coefficients are the ones Dynamo's mocker engine was fitted with (a vLLM engine on
//! one GPU), so simulated latencies have a realistic shape; they are all flags of `kvroute sim`.

use crate::SimError;

/// Nanoseconds of virtual time.
pub type Nanos = u64;

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
}

impl Default for TimingModel {
    fn default() -> Self {
        Self {
            prefill_coefficients: [4.209989e-7, 1.518344e-2, 16.50142],
            decode_coefficients: [-25.74, 54.01, 5.74],
            decode_min_ms: 1.0,
            speedup: 1.0,
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

    /// Duration of one step, in nanoseconds of virtual time (at least 1 ns, so time advances).
    pub fn step_nanos(&self, prefill_tokens: u64, decodes: bool, usage: f64) -> Nanos {
        let mut ms = 0.0;
        if prefill_tokens > 0 {
            ms += self.prefill_ms(prefill_tokens);
        }
        if decodes {
            ms += self.decode_ms(usage);
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

    #[test]
    fn step_adds_both_phases_and_divides_by_the_speedup() {
        let m = TimingModel::default();
        let both = m.prefill_ms(1000) + m.decode_ms(0.25);
        assert_eq!(m.step_nanos(1000, true, 0.25), (both * 1e6).round() as u64);
        assert_eq!(
            m.step_nanos(0, true, 0.0),
            (5.74f64 * 1e6).round() as u64,
            "a decode-only step"
        );
        let fast = TimingModel { speedup: 4.0, ..m };
        assert_eq!(
            fast.step_nanos(1000, true, 0.25),
            (both * 1e6 / 4.0).round() as u64
        );
        assert_eq!(
            m.step_nanos(0, false, 0.0),
            1,
            "an empty step still advances time"
        );
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
