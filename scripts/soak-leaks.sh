#!/usr/bin/env bash
# Nothing leaks over time: one coordinator, one long job whose membership churns (a worker
# joins, trains, is SIGKILLed mid-job, another joins: two generations per cycle, thousands
# over the run) and a stream of short jobs beside it (hundreds, each two workers that train
# and finish). Every SAMPLE seconds it records, from the processes' /metrics, the
# coordinator's and the three long-lived workers' resident memory, open descriptors and
# live tokio tasks, the store's key count and the coordinator's metric series that carry a job
# label; at the end it compares the last sample with
# the first one after the warm-up and fails if anything grew beyond the allowance.
#
#   bash scripts/soak-leaks.sh [DURATION_SECONDS] [OUT_DIR]
#
# Needs the release binaries (cargo build --release -p cohort-worker -p cohort-coordinator --bins).
# Everything runs on 127.0.0.1 with ports the processes pick; nothing outlives the script.
set -euo pipefail

DURATION=${1:-600}
OUT=${2:-$(mktemp -d /tmp/cohort-soak-leaks.XXXXXX)}
SAMPLE=${SAMPLE:-15}
WARMUP=${WARMUP:-60}
ENDED_TTL=${ENDED_TTL:-30s}
# Failure histories live a window past their last failure: a short one shows the plateau
# within the run (the default of `serve` is 10 min).
EXCLUSION_WINDOW=${EXCLUSION_WINDOW:-60s}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
BIN=${COHORT_BIN:-$ROOT/target/release}
mkdir -p "$OUT"
for b in cohort-coordinator cohort-worker; do
  [[ -x $BIN/$b ]] || { echo "missing $BIN/$b: cargo build --release -p cohort-worker -p cohort-coordinator --bins" >&2; exit 2; }
done

PIDS=()
cleanup() {
  for p in "${PIDS[@]}"; do kill -9 "$p" 2>/dev/null || true; done
  pkill -9 -f -- "--token-file $OUT/token" 2>/dev/null || true
  wait 2>/dev/null || true
}
trap cleanup EXIT

head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n' >"$OUT/token"

# Prints the value after `KEY=` or `KEY ` in the first line of FILE matching PATTERN, waiting
# at most 20 s for it to appear.
wait_for_line() {
  local file=$1 pattern=$2 deadline=$((SECONDS + 20))
  until grep -q -- "$pattern" "$file" 2>/dev/null; do
    ((SECONDS < deadline)) || { echo "no '$pattern' in $file within 20 s" >&2; tail -5 "$file" >&2; exit 1; }
    sleep 0.1 # polling a log file for a process's first line, bounded above
  done
  grep -m1 -- "$pattern" "$file"
}

"$BIN/cohort-coordinator" serve --store "${STORE:-memory}" --listen 127.0.0.1:0 --metrics 127.0.0.1:0 --token-file "$OUT/token" \
  --min-workers 2 --join-window 100ms --heartbeat-interval 200ms --lease-ttl 2s --ended-ttl "$ENDED_TTL" \
  --exclusion-threshold 1000000 --exclusion-window "$EXCLUSION_WINDOW" >"$OUT/coordinator.log" 2>&1 &
COORD_PID=$!
PIDS+=("$COORD_PID")
COORD=$(wait_for_line "$OUT/coordinator.log" "cohort-coordinator listening on" | awk '{print $NF}')
COORD_METRICS=$(wait_for_line "$OUT/coordinator.log" "cohort-coordinator metrics on" | awk '{print $NF}')

# Always started in the background (`train ... &`): exec makes `$!` the worker's own pid.
train() { # JOB ID STEPS LOG [extra args]
  local job=$1 id=$2 steps=$3 log=$4
  shift 4
  exec "$BIN/cohort-worker" train --coordinator "$COORD" --job "$job" --worker-id "$id" --token-file "$OUT/token" \
    --steps "$steps" --size 256K --step-interval 5ms --no-progress-timeout 2s "$@" >"$log" 2>&1
}

LONG_METRICS=()
for i in 0 1 2; do
  train soak-long "long-$i" 1000000000 "$OUT/long-$i.log" --metrics 127.0.0.1:0 &
  PIDS+=("$!")
done
for i in 0 1 2; do
  LONG_METRICS+=("$(wait_for_line "$OUT/long-$i.log" "event=metrics" | sed 's/.*address=//; s/ .*//')")
done

# The churn: a fresh worker id each cycle (as a replacement pod would have), SIGKILLed once
# it has trained a few steps in a generation with the long-lived workers.
churn() {
  local n=0
  while true; do
    n=$((n + 1))
    local log="$OUT/churn.log"
    train soak-long "churn-$n" 1000000000 "$log" &
    local pid=$!
    local deadline=$((SECONDS + 30))
    until [[ $(grep -c "event=step" "$log" 2>/dev/null || true) -ge 3 ]]; do
      ((SECONDS < deadline)) || break
      kill -0 "$pid" 2>/dev/null || break
      sleep 0.05 # polling the churn worker's log, bounded above
    done
    kill -9 "$pid" 2>/dev/null || true
    wait "$pid" 2>/dev/null || true
    echo "$n" >"$OUT/churn.count"
  done
}
churn &
PIDS+=("$!")

# The short jobs: two at a time, each two workers of 20 steps that finish the job.
short_jobs() {
  local j=0
  while true; do
    local pids=()
    for k in 0 1; do
      local job="short-$((j + k))"
      train "$job" a 20 "$OUT/short.log" &
      pids+=("$!")
      train "$job" b 20 "$OUT/short.log" &
      pids+=("$!")
    done
    for p in "${pids[@]}"; do wait "$p" || echo "a short job's worker failed (exit $?)" >>"$OUT/short-failures.log"; done
    j=$((j + 2))
    echo "$j" >"$OUT/short.count"
  done
}
short_jobs &
PIDS+=("$!")

metric() { # ADDR NAME -> value or -
  curl -s --max-time 5 "http://$1/metrics" 2>/dev/null | awk -v n="$2" '$1 == n {print $2; found=1} END {if (!found) print "-"}'
}
job_series() { # ADDR -> how many metric series carry a job label (they must not pile up)
  curl -s --max-time 5 "http://$1/metrics" 2>/dev/null | grep -c 'job="' || true
}

printf '%6s %8s %9s %6s %6s %6s %6s %9s %6s %6s %7s %7s %7s\n' t_s gens coord_kb c_fds c_tasks keys jobs w0_kb w0_fds w0_tsk w1_kb w2_kb series \
  | tee "$OUT/samples.txt"
START=$SECONDS
while ((SECONDS - START < DURATION)); do
  sleep "$SAMPLE" # the sampling period of the measurement, not synchronisation
  kill -0 "$COORD_PID" || { echo "the coordinator died" >&2; exit 1; }
  row=("$((SECONDS - START))"
    "$(metric "$COORD_METRICS" cohort_generations_formed_total)"
    "$(($(metric "$COORD_METRICS" process_resident_memory_bytes) / 1024))"
    "$(metric "$COORD_METRICS" process_open_fds)"
    "$(metric "$COORD_METRICS" cohort_runtime_alive_tasks)"
    "$(metric "$COORD_METRICS" cohort_store_keys)"
    "$(cat "$OUT/short.count" 2>/dev/null || echo 0)")
  w0_rss=$(metric "${LONG_METRICS[0]}" process_resident_memory_bytes)
  row+=("$((w0_rss / 1024))" "$(metric "${LONG_METRICS[0]}" process_open_fds)" "$(metric "${LONG_METRICS[0]}" cohort_runtime_alive_tasks)")
  for i in 1 2; do row+=("$(($(metric "${LONG_METRICS[$i]}" process_resident_memory_bytes) / 1024))"); done
  row+=("$(job_series "$COORD_METRICS")")
  printf '%6s %8s %9s %6s %6s %6s %6s %9s %6s %6s %7s %7s %7s\n' "${row[@]}" | tee -a "$OUT/samples.txt"
done

churns=$(cat "$OUT/churn.count" 2>/dev/null || echo 0)
shorts=$(cat "$OUT/short.count" 2>/dev/null || echo 0)
failures=$(wc -l <"$OUT/short-failures.log" 2>/dev/null || echo 0)
gen_long=$(grep -o "event=generation gen=[0-9]*" "$OUT/long-0.log" | tail -1 | sed 's/.*gen=//')
echo "churn cycles: $churns; short jobs: $shorts (failed workers: $failures); long job's generation: ${gen_long:-?}; logs: $OUT"

# Verdict: the last sample against the first after the warm-up.
python3 - "$OUT/samples.txt" "$WARMUP" <<'EOF'
import sys
rows = [l.split() for l in open(sys.argv[1]) if l.strip() and not l.startswith("t_s") and not l.lstrip().startswith("t_s")]
rows = [r for r in rows if r[0].isdigit()]
base = next((r for r in rows if int(r[0]) >= int(sys.argv[2])), None)
last = rows[-1] if rows else None
if base is None or last is base:
    print("not enough samples after the warm-up for a verdict"); sys.exit(1)
cols = {"coord_kb": 2, "c_fds": 3, "c_tasks": 4, "keys": 5, "w0_kb": 7, "w0_fds": 8, "w0_tsk": 9, "w1_kb": 10, "w2_kb": 11,
        "series": 12}
# Allowances: memory may settle (allocator arenas, buffers sized by the largest message)
# but not grow with time; descriptors and tasks vary by the connections and calls in flight.
allow = {"coord_kb": lambda b: b * 1.25 + 8192, "w0_kb": lambda b: b * 1.25 + 8192, "w1_kb": lambda b: b * 1.25 + 8192,
         "w2_kb": lambda b: b * 1.25 + 8192, "c_fds": lambda b: b + 16, "c_tasks": lambda b: b + 32,
         "w0_fds": lambda b: b + 16, "w0_tsk": lambda b: b + 32, "keys": lambda b: b + 64,
         "series": lambda b: b + 64}
bad = []
for name, i in cols.items():
    try:
        b, l = float(base[i]), float(last[i])
    except ValueError:
        bad.append(f"{name}: unreadable ({base[i]} -> {last[i]})"); continue
    peak = max(float(r[i]) for r in rows if r[i] not in "-" and int(r[0]) >= int(sys.argv[2]))
    print(f"{name:>9}: after warm-up {b:.0f}, last {l:.0f}, peak {peak:.0f}")
    if l > allow[name](b):
        bad.append(f"{name} grew from {b:.0f} to {l:.0f}")
print("FLAT" if not bad else "GREW: " + "; ".join(bad))
sys.exit(1 if bad else 0)
EOF
