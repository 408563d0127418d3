#!/usr/bin/env bash
# The GPU checks of issue 50, as one script for a machine with a CUDA device (the H200 lent to
# some sessions): what the machine is, whether it has an RDMA NIC, then python/tests/test_cuda.py
# (the cohort backend on CUDA tensors with 1, 2 and 4 processes sharing the GPU, and the managed
# backend with nccl at world size 1, abort included) and, as a regression on a machine where
# the cohort backend also registers the CUDA device, the CPU calls of test_torch_backend.py
# and test_managed.py's misuse test.
#
#   scripts/device-check.sh OUT_DIR
#
# Needs: python3 with torch 2.x (CUDA) and pytest; the release cohort-coordinator in
# $COHORT_BIN_DIR; the extension python/cohort/_native*.so (scripts/python-env.sh builds it).
# Writes OUT_DIR/machine.txt, OUT_DIR/rdma.txt, OUT_DIR/pytest.log and OUT_DIR/timings.jsonl
# (the cohort backend's all_reduce on CUDA beside host tensors; docs/benchmarks.md).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: scripts/device-check.sh OUT_DIR}
mkdir -p "$out"
py=${PYTHON:-python3}
{
  date -u +%Y-%m-%dT%H:%M:%SZ
  uname -srm
  nproc
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  "$py" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "nccl", torch.cuda.nccl.version(), torch.cuda.get_device_name(0))'
} >"$out/machine.txt" 2>&1
cat "$out/machine.txt"
{
  if command -v ibv_devices >/dev/null; then ibv_devices; else echo "ibv_devices: not installed"; fi
  echo "/sys/class/infiniband: $(ls /sys/class/infiniband 2>/dev/null | tr '\n' ' ')"
} >"$out/rdma.txt" 2>&1
cat "$out/rdma.txt"
export PYTHONPATH=$PWD/python${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 COHORT_REQUIRE_PYTHON=1
rc=0
timeout 300 "$py" -m pytest -x -q -s -p no:cacheprovider python/tests/test_cuda.py 2>&1 | tee "$out/pytest.log" || rc=1
grep '^{"event": "timing"' "$out/pytest.log" >"$out/timings.jsonl" || true
timeout 150 "$py" -m pytest -x -q -p no:cacheprovider python/tests/test_torch_backend.py::test_every_torch_distributed_call_matches_the_local_answer "python/tests/test_managed.py::test_misuse_is_refused_and_a_revoked_generation_raises_its_root_cause" 2>&1 | tee -a "$out/pytest.log" || rc=1
echo "device-check rc=$rc"
exit $rc
