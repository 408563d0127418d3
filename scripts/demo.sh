#!/usr/bin/env bash
# The main job (README.md): installs what the build needs when missing, then runs the demo:
# a local elastic job on the embedded coordinator, one rank SIGKILLed mid-allreduce, the
# survivors re-form, a new worker joins, every step verified. Extra arguments go to the demo.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/ensure-deps.sh build >&2
cargo build --release --locked -p cohort-coordinator -p cohort-worker -p cohort-chaos --bins
exec target/release/cohort-chaos demo "$@"
