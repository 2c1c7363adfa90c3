//! The simulator's errors.

/// Everything that can go wrong in a simulation.
#[derive(Debug, thiserror::Error)]
pub enum SimError {
    /// A knob has a value the simulator cannot use.
    #[error("invalid --{knob}: {reason}")]
    Invalid { knob: &'static str, reason: String },
    /// A trace line could not be used.
    #[error("trace line {line}: {reason}")]
    Trace { line: usize, reason: String },
    /// A policy exists but cannot run in this build.
    #[error("policy {policy} is unavailable: {reason}")]
    Unavailable { policy: String, reason: String },
    /// The selector refused a call the simulator made.
    #[error("selector: {0}")]
    Selector(#[from] kvroute_core::error::Error),
    /// Drawing the chart failed.
    #[error("plot: {0}")]
    Plot(String),
    /// A broken simulator invariant (a bug).
    #[error("internal simulator error: {0}")]
    Internal(String),
}

impl SimError {
    pub(crate) fn invalid(knob: &'static str, reason: impl Into<String>) -> Self {
        SimError::Invalid {
            knob,
            reason: reason.into(),
        }
    }
}
