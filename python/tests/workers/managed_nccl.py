"""The managed backend with nccl on one GPU, world size 1: ``managed_nccl.py ENDPOINT JOB``.
nccl all_reduce and broadcast on CUDA tensors and gloo on CPU ones under one default group;
the watchdog sees each nccl call complete on the GPU; after the generation is revoked the
nccl communicator is aborted (``ProcessGroupNCCL.abort()``) and every later call raises the
revocation's root cause. Prints ``ok ...`` lines, then ``done``."""

import sys
import time

import torch
import torch.distributed as dist

import cohort
import cohort.elastic
import cohort.torch.managed as managed
from cohort.errors import CollectiveError

endpoint, job = sys.argv[1:3]
group = cohort.Group(job, endpoint, "solo")
state = cohort.elastic.ObjectState(group, step=0)
state.reform()
dev = torch.device("cuda", 0)
torch.cuda.set_device(dev)

managed.init_process_group(state, backend="nccl", timeout=60)
t = torch.arange(1 << 20, dtype=torch.float32, device=dev)
dist.all_reduce(t)
assert torch.equal(t, torch.arange(1 << 20, dtype=torch.float32, device=dev))
b = torch.full((3,), 5.0, device=dev)
work = dist.broadcast(b, 0, async_op=True)
work.wait()
assert b.tolist() == [5.0, 5.0, 5.0], b
c = torch.arange(4, dtype=torch.float32)
dist.all_reduce(c)  # CPU: the managed gloo group
assert c.tolist() == [0.0, 1.0, 2.0, 3.0], c
print(f"ok nccl all_reduce broadcast, gloo all_reduce, backend={dist.get_backend()}", flush=True)

# The watchdog asks each nccl Work whether the GPU finished it (it polls every 0.25 s).
gen = managed._generation
deadline = time.monotonic() + 5
while time.monotonic() < deadline and any(not c.done for c in gen._calls):
    time.sleep(0.05)  # polling the watchdog's view, bounded by the deadline
assert all(c.done for c in gen._calls), [(c.name, c.done) for c in gen._calls]
kinds = sorted(b().kind for b in gen._backends if b() is not None)
assert "nccl" in kinds, kinds  # one group for both devices where torch takes a Python process group
print("ok the watchdog saw every nccl call complete", flush=True)

reported = state.comm.report_failure("test: the generation is declared failed")
assert isinstance(reported, CollectiveError), reported
start = time.monotonic()
deadline = start + 10
while time.monotonic() < deadline and managed.current() is None:
    time.sleep(0.01)  # the watchdog's reaction, bounded by the deadline
assert managed.current() is not None, "the watchdog did not fail the generation"
nccl_backend = next(b() for b in gen._backends if b() is not None and b().kind == "nccl")
while time.monotonic() < deadline and not nccl_backend.aborted and nccl_backend.abort_error is None:
    time.sleep(0.01)  # the abort follows the failure on the watchdog's thread; bounded
assert nccl_backend.aborted, f"ProcessGroupNCCL.abort() did not return: {nccl_backend.abort_error!r}"
print(f"ok aborted in {time.monotonic() - start:.3f} s", flush=True)
try:
    dist.all_reduce(t)
except CollectiveError as e:
    assert "declared failed" in str(e), e
    print(f"ok after revocation: {type(e).__name__}: {e}", flush=True)
else:
    raise SystemExit("an nccl call ran on a revoked generation")
group.leave(finished=True)
print("done", flush=True)
