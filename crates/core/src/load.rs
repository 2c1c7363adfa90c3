//! Per-rank load tracking (in progress).
