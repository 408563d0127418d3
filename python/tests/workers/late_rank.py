"""Worker for the late-rank tests. argv: MODE COORDINATOR JOB WORKER_ID TRANSPORT SECONDS [KIND].

Modes (every setting left at its default but the transport, unless said):
  checkpoint  three verified allreduces; then rank 0 "writes a checkpoint" for SECONDS (KIND
              `sleep`: it sleeps, as a write to slow storage does; `burn`: it computes) while
              rank 1 waits in the fourth allreduce; then three more. Prints `done` with the
              time rank 1's fourth allreduce took, or `error` and exits 1.
  endless     late_rank_timeout=SECONDS: three verified allreduces; then rank 1 computes
              forever (an endless loop in user code) while rank 0 waits in the fourth; rank 0
              prints the `error` it gets (class, root cause) and exits.
"""

import json
import sys
import time

import numpy as np

import cohort

mode, coordinator, job, worker_id, transport, seconds = sys.argv[1:7]
seconds = float(seconds)
kind = sys.argv[7] if len(sys.argv) > 7 else "sleep"


def report(event: str, **facts) -> None:
    print(json.dumps({"event": event, "worker": worker_id, **facts}), flush=True)


options = {"transport": transport}
if mode == "endless":
    options["late_rank_timeout"] = seconds
group = cohort.Group(job, coordinator, worker_id, **options)
comm = group.next_generation()
report("joined", rank=comm.rank, size=comm.size, generation=comm.generation, transport=comm.transport)


def step(n: int) -> float:
    data = np.full(1 << 16, comm.rank + 1 + n, dtype=np.float32)
    t0 = time.monotonic()
    comm.allreduce(data)
    took = time.monotonic() - t0
    expected = sum(r + 1 + n for r in range(comm.size))
    assert (data == expected).all(), (data[:4], expected)
    report("step", step=n, took=took)
    return took


def busy(until: float) -> None:
    x = 0
    while time.monotonic() < until:
        x = (x * 6364136223846793005 + 1) % (1 << 64)


try:
    for n in range(3):
        step(n)
    if mode == "checkpoint":
        if comm.rank == 0:
            report("checkpoint", seconds=seconds, kind=kind)
            if kind == "burn":
                busy(time.monotonic() + seconds)
            else:
                time.sleep(seconds)
        waited = step(3)
        for n in range(4, 7):
            step(n)
        report("done", waited=waited, generation=comm.generation)
        group.leave(finished=True)
    elif mode == "endless":
        if comm.rank == 1:
            report("endless")
            busy(float("inf"))
        step(3)
        report("done", generation=comm.generation)
except cohort.CollectiveError as e:
    report(
        "error",
        cls=type(e).__name__,
        generation=e.generation,
        cause_rank=e.rank,
        cause_worker=e.worker_id,
        reason=e.reason,
        message=str(e),
    )
    sys.exit(1)
