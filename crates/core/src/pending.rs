//! Pending-selection cache (in progress).
