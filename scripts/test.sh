#!/usr/bin/env bash
# Runs every kvroute test: Rust unit, property and integration tests (and, as they land, the
# Python binding tests). This is the README's test command; .ci/run calls it.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo test --workspace --all-targets --locked
cargo test --workspace --doc --locked
