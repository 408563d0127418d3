"""A worker that allreduces and reports a commit point per step until STOP_FILE exists.

argv: COORDINATOR JOB WORKER_ID STOP_FILE. Prints `committed N` after its first commits.
The stop is agreed on, not seen alone: each step's allreduce carries whether this rank saw
the file, so every rank leaves after the same step (a rank that stopped on its own would
leave its peers inside an allreduce it never joins)."""

import os
import sys
import time

import numpy as np

import cohort

coordinator, job, worker_id, stop_file = sys.argv[1:5]
group = cohort.Group(job, coordinator, worker_id, no_progress_timeout=20.0)
comm = group.next_generation()
step = 0
deadline = time.monotonic() + 60  # bounded: the test stops it well before
while time.monotonic() < deadline:
    x = np.ones(1024, dtype=np.float32)
    x[1] = 1.0 if os.path.exists(stop_file) else 0.0
    comm.allreduce(x)
    assert x[0] == comm.size
    if x[1] > 0:
        break
    step += 1
    group.commit(comm.generation, step, step.to_bytes(8, "little"))
    if step == 5:
        print("committed 5", flush=True)
    time.sleep(0.01)  # pacing, not synchronisation: the loop's steps are unbounded otherwise
comm.close()
group.leave(finished=True)
print("done", flush=True)
