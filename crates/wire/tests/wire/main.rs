//! Integration tests of kvroute-wire: fixtures from the real encoder (msgspec), round trips
//! through our encoder, and robustness against arbitrary input.

// Test helpers outside #[test] functions may unwrap: a failure there is a failed test.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;
mod fixtures;
mod robustness;
mod roundtrip;
