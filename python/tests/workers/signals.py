"""Worker for the signal tests (python/tests/test_signals.py). argv: MODE COORDINATOR JOB WORKER_ID.

Every mode installs Python's own SIGINT handler first: a process launched with SIGINT ignored
(a background job of a non-interactive shell, a CI runner's children) inherits the ignoring.

Modes:
  idle        joins, prints `joined`, then waits on stdin (the peer that never calls), then
              allreduces one tensor of 1000 ones (the call a `moved` peer waits for).
  moved       rank 0 of 2: blocks in an allreduce of a torch tensor; its SIGUSR1 handler (run by
              the call's look for signals) re-points the tensor to other memory with `set_`;
              prints how the call ended.
  spare       joins a job whose only place is taken and waits in next_generation (SIGTERM).
  raw-loop    allreduces a NumPy array forever (SIGTERM); on a collective error prints it.
  dist-loop   as raw-loop through torch.distributed's all_reduce on the cohort backend.
  dist-block  rank 0 blocks in torch.distributed's all_reduce, its peer never joining (SIGINT).
  async-block rank 0 waits on the Work of an allreduce_async, its peer never joining (SIGINT),
              then closes its group and says how long the close took.
"""

import json
import signal
import sys
import time

import numpy as np

import cohort

mode, coordinator, job, worker_id = sys.argv[1:5]
signal.signal(signal.SIGINT, signal.default_int_handler)


def report(kind: str, **facts) -> None:
    print(json.dumps({"event": kind, "worker": worker_id, **facts}), flush=True)


group = cohort.Group(job, coordinator, worker_id, no_progress_timeout=30.0)
if mode == "spare":
    report("waiting")
    group.next_generation()
    report("formed")  # not expected: the test never frees the place
    sys.exit(3)

comm = group.next_generation()
report("joined", rank=comm.rank, size=comm.size, generation=comm.generation)

if mode == "idle":
    sys.stdin.readline()
    import torch

    comm.allreduce(torch.ones(1000))
    report("idle-done")
    group.leave(finished=True)

elif mode == "moved":
    import torch

    t = torch.ones(1000)
    elsewhere = torch.full((1000,), 7.0)

    def move(*_):
        t.set_(elsewhere)
        report("moved")

    signal.signal(signal.SIGUSR1, move)
    report("blocking")
    try:
        comm.allreduce(t)
        report("returned", first=t[0].item())
    except cohort.CohortError as e:
        report("changed", cls=type(e).__name__, message=str(e), first=t[0].item())
    group.leave(finished=True)

elif mode == "raw-loop":
    data = np.ones(1 << 16, dtype=np.float32)
    step = 0
    try:
        while True:
            comm.allreduce(data)
            step += 1
            if step <= 3 or step % 1000 == 0:
                report("step", step=step)
    except cohort.CollectiveError as e:
        report("error", cls=type(e).__name__, message=str(e))

elif mode == "dist-loop":
    import torch
    import torch.distributed as dist

    import cohort.torch as ct

    ct.init_process_group(comm)
    data = torch.ones(1 << 16)
    step = 0
    try:
        while True:
            dist.all_reduce(data)
            step += 1
            if step <= 3 or step % 1000 == 0:
                report("step", step=step)
    except Exception as e:  # noqa: BLE001 - the peer's failure, as torch raises it
        report("error", cls=type(e).__name__, message=str(e))

elif mode == "dist-block":
    import torch
    import torch.distributed as dist

    import cohort.torch as ct

    ct.init_process_group(comm)
    data = torch.ones(1000)
    try:
        report("blocking")
        dist.all_reduce(data)
        report("returned")
    except KeyboardInterrupt:
        report("interrupted", at=time.time())
    group.close()

elif mode == "async-block":
    data = np.ones(1000, dtype=np.float32)
    try:
        report("blocking")
        comm.allreduce_async(data).wait()
        report("returned")
    except KeyboardInterrupt:
        report("interrupted", at=time.time())
    # The queued call was aborted with the interrupted wait: the close does not wait for it.
    started = time.monotonic()
    group.close()
    report("closed", seconds=time.monotonic() - started)
