#!/usr/bin/env bash
# The test command (README.md). On a fresh Debian machine it installs what the build needs,
# then builds and runs every test of the workspace. Every test is bounded in time and starts
# and stops what it needs (etcd on a free loopback port, coordinators, worker processes).
set -euo pipefail
cd "$(dirname "$0")/.."

bash scripts/ensure-deps.sh

export CARGO_TERM_COLOR=never
export RUST_BACKTRACE=1

echo "== build"
cargo build --workspace --all-targets --locked

echo "== tests"
cargo test --workspace --locked -- --test-threads="${COHORT_TEST_THREADS:-2}"
