#!/usr/bin/env bash
# Coverage-guided fuzzing (libFuzzer, through cargo-fuzz) of one target in fuzz/ for a number
# of seconds; without a target, every target in turn. Stable Rust: RUSTC_BOOTSTRAP=1 lets
# cargo-fuzz pass its -Z flags, and no sanitizer is used (ASan needs a nightly std), so the
# property is Rust's own: no panic, no abort, no out-of-memory (-rss_limit_mb).
#
#   bash scripts/fuzz.sh                    # every target, 60 s each
#   bash scripts/fuzz.sh handshake 600      # one target, 10 minutes
#
# Crashes land in fuzz/artifacts/TARGET/; the corpus grows in fuzz/corpus/TARGET/ (both
# ignored by git). A crash found is fixed and kept as a regression test beside the
# property-based tests (transports/tests/fuzz_decoders.rs and the crates' unit tests).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/ensure-deps.sh test >&2
command -v cargo-fuzz >/dev/null 2>&1 || cargo install cargo-fuzz --locked
targets=(tcp_frame handshake rdma_address settings_toml scenario_toml)
[ $# -ge 1 ] && targets=("$1")
seconds=${2:-60}
for t in "${targets[@]}"; do
  echo "== fuzz $t for ${seconds}s"
  RUSTC_BOOTSTRAP=1 cargo fuzz run --sanitizer none "$t" -- \
    -max_total_time="$seconds" -rss_limit_mb=2048 -print_final_stats=1 2>&1 |
    grep -E '^(#[0-9]+ +DONE|Done|stat::|INFO: Loaded|==[0-9]+== ERROR|SUMMARY)|panicked' || true
done
