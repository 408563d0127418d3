#!/usr/bin/env bash
# Times allreduce for one or more cohort-worker binaries (shared memory and TCP) and Open MPI
# (btl self,vader and btl self,tcp) in one run, beside LOAD CPU-bound processes
# (`python3 -c 'while 1: pass'`, as in ../shared/peers/compare.sh): the "Under load" figures of
# docs/benchmarks.md. Several binaries give a before/after comparison within the same minute.
#
# Usage: LOAD=N scripts/under-load.sh RANKS SIZES ITERS BIN [BIN...]
#   e.g. LOAD=2 scripts/under-load.sh 2 4096,65536,1048576 20 /tmp/main-cohort-worker target/release/cohort-worker
# TRANSPORTS (default "shm tcp"), BENCHARGS (extra bench flags), NOMPI=1 (skip Open MPI).
# Needs openmpi-bin and python3-mpi4py for the Open MPI rows (compare.sh installs them).
# Output: one `peer=NAME ranks= bytes= median_us= ...` line per system and size, NAME being
# the binary's file name and transport, ompi-vader or ompi-tcp.
set -euo pipefail
ranks=${1:?ranks}; sizes=${2:?sizes}; iters=${3:?iters}; shift 3
[ $# -gt 0 ] || { echo "usage: LOAD=N $0 RANKS SIZES ITERS BIN [BIN...]" >&2; exit 2; }
peers=$(cd "$(dirname "$0")/../../shared/peers" 2>/dev/null && pwd || echo /work/shared/peers)
pids=()
trap 'for p in "${pids[@]:-}"; do [ -n "$p" ] && kill "$p" 2>/dev/null; done' EXIT
for _ in $(seq 1 "${LOAD:-0}"); do python3 -c 'while 1: pass' & pids+=($!); done
echo "# $(date -u +%FT%H:%M:%SZ) ranks=$ranks load=${LOAD:-0} loadavg=$(cut -d' ' -f1 /proc/loadavg)"
for b in "$@"; do
  for t in ${TRANSPORTS:-shm tcp}; do
    # shellcheck disable=SC2086
    "$b" bench --ranks "$ranks" --sizes "$sizes" --iters "$iters" --transport "$t" ${BENCHARGS:-} \
      | grep '^peer=' | sed "s|^peer=cohort|peer=$(basename "$b")-$t|"
  done
done
if [ -z "${NOMPI:-}" ]; then
  for btl in vader tcp; do
    mpirun -np "$ranks" --oversubscribe --allow-run-as-root --mca btl self,$btl \
      /usr/bin/python3 "$peers/mpi_allreduce.py" "$sizes" "$iters" 2>/dev/null \
      | grep '^peer=' | sed "s/^peer=openmpi /peer=ompi-$btl /"
  done
fi
echo "# end $(date -u +%H:%M:%S) loadavg=$(cut -d' ' -f1 /proc/loadavg)"
