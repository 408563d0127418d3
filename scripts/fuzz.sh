#!/usr/bin/env bash
# Coverage-guided fuzzing (libFuzzer, through cargo-fuzz) of one target in fuzz/ for a number
# of seconds; without a target, every target in turn. Stable Rust: RUSTC_BOOTSTRAP=1 lets
# cargo-fuzz pass its -Z flags, and no sanitizer is used (ASan needs a nightly std), so the
# property is Rust's own: no panic, no abort, no out-of-memory (-rss_limit_mb).
#
#   bash scripts/fuzz.sh                    # every target, 60 s each
#   bash scripts/fuzz.sh handshake 600      # one target, 10 minutes
#
# Each run starts from the committed seeds (fuzz/seeds/TARGET/, replayed by `cargo test` in
# the crate that owns the parser) and grows its corpus in fuzz/corpus/TARGET/ (ignored by
# git). A crash fails the script (exit 1, after the remaining targets ran), with its input in
# fuzz/artifacts/TARGET/: fix it, and add the input to the seeds so that it stays replayed.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/ensure-deps.sh test >&2
command -v cargo-fuzz >/dev/null 2>&1 || cargo install cargo-fuzz --locked
targets=(tcp_frame handshake rdma_address shm_slot_header shm_descriptor settings_toml scenario_toml)
[ $# -ge 1 ] && targets=("$1")
seconds=${2:-60}
failed=()
for t in "${targets[@]}"; do
  echo "== fuzz $t for ${seconds}s"
  mkdir -p "fuzz/corpus/$t"
  log=$(mktemp)
  rc=0
  RUSTC_BOOTSTRAP=1 cargo fuzz run --sanitizer none "$t" "fuzz/corpus/$t" "fuzz/seeds/$t" -- \
    -max_total_time="$seconds" -rss_limit_mb=2048 -print_final_stats=1 >"$log" 2>&1 || rc=$?
  # The summary (grep finds nothing in a log without one: not an error here).
  grep -E '^(#[0-9]+[[:space:]]+DONE|Done|stat::|INFO: Loaded|==[0-9]+== ERROR|SUMMARY|artifact_prefix|Test unit written)|panicked' "$log" || true
  if [ "$rc" -ne 0 ]; then
    echo "FUZZ FAILURE: $t exited $rc; the last lines of its log:"
    tail -n 30 "$log"
    failed+=("$t")
  fi
  rm -f "$log"
done
if [ ${#failed[@]} -gt 0 ]; then
  echo "fuzz targets that failed: ${failed[*]}"
  exit 1
fi
