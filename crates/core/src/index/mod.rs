//! The radix index (in progress).
