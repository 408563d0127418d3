"""Misuse of cohort.torch.managed on a job of one worker: ``managed_misuse.py ENDPOINT JOB``.
Bad arguments are refused before anything runs; a managed gloo group works; after the
generation is revoked (a failure reported through cohort), the next managed call raises the
revocation's root cause instead of running on gloo. Prints ``ok ...`` lines, then ``done``."""

import sys
import time

import torch
import torch.distributed as dist

import cohort
import cohort.elastic
import cohort.torch.managed as managed
from cohort.errors import CollectiveError, InvalidArgumentError

endpoint, job = sys.argv[1:3]

for call, words in (
    (lambda: managed.init_process_group(object()), "elastic state"),
    # nccl: refused where it cannot run (no GPU, or torch 1.13); elsewhere the bad state is.
    (
        lambda: managed.init_process_group(object(), backend="nccl"),
        "elastic state" if managed.nccl_available() else "cohort.torch.nccl",
    ),
):
    try:
        call()
    except InvalidArgumentError as e:
        assert words in str(e), e
        print(f"ok refused: {e}", flush=True)
    else:
        raise SystemExit("a misuse was not refused")

group = cohort.Group(job, endpoint, "solo")
state = cohort.elastic.ObjectState(group, step=0)
state.reform()
for bad in (0, -1.0, float("nan"), "10"):
    try:
        managed.init_process_group(state, timeout=bad)
    except InvalidArgumentError:
        print(f"ok refused timeout {bad!r}", flush=True)
    else:
        raise SystemExit(f"timeout {bad!r} was not refused")
try:
    managed.init_process_group(state, backend="mpi")
except InvalidArgumentError:
    print("ok refused backend mpi", flush=True)
for kwargs in ({"reason": ""}, {"reason": "x", "peer": 0}, {"reason": "x", "peer": 7}, {"reason": "x", "probe": -1}):
    try:
        state.comm.report_failure(**kwargs)
    except InvalidArgumentError:
        print(f"ok report_failure refused {sorted(kwargs)}", flush=True)
    else:
        raise SystemExit(f"report_failure({kwargs}) was not refused")
assert state.comm.wait_revoked(0.05) is None

pg = managed.init_process_group(state, timeout=60)
assert dist.get_backend() == managed.BACKEND, dist.get_backend()
t = torch.arange(4, dtype=torch.float32)
dist.all_reduce(t)
assert t.tolist() == [0.0, 1.0, 2.0, 3.0], t
print(f"ok gloo all_reduce backend={dist.get_backend()}", flush=True)

# A new group (here a second init in the same generation) deletes the earlier one's
# rendezvous keys, off the caller's path: the earlier scope empties.
first = managed._store
assert first is not None and first.num_keys() > 0, first
managed.init_process_group(state, timeout=60)
assert managed._store is not first
deadline = time.monotonic() + 10
while time.monotonic() < deadline and first.num_keys() > 0:
    time.sleep(0.02)  # the sweep runs on its own thread; bounded by the deadline
assert first.num_keys() == 0, f"{first.num_keys()} keys left in {first.scope}"
dist.all_reduce(t)
assert t.tolist() == [0.0, 1.0, 2.0, 3.0], t
print(f"ok the earlier group's keys deleted ({first.scope})", flush=True)

# The generation fails (as a peer's report would make it): the watchdog learns the revocation,
# and the next managed call raises its root cause.
reported = state.comm.report_failure("test: the generation is declared failed")
assert isinstance(reported, CollectiveError), reported
revoked = state.comm.wait_revoked(10.0)
assert revoked is not None and "declared failed" in str(revoked), revoked
try:
    dist.all_reduce(t)
except CollectiveError as e:
    assert "declared failed" in str(e), e
    print(f"ok after revocation: {type(e).__name__}: {e}", flush=True)
else:
    raise SystemExit("a managed call ran on a revoked generation")
group.leave(finished=True)
print("done", flush=True)
