"""Joins with the `transport` argument given, allreduces once, and prints the transport the
generation used and whether the sum was right (one JSON line).

    transport.py COORDINATOR JOB WORKER_ID TRANSPORT
"""

import json
import sys

import numpy as np

import cohort

coordinator, job, worker_id, transport = sys.argv[1:5]
group = cohort.Group(job, coordinator, worker_id, transport=transport)
comm = group.next_generation()
x = np.full(1 << 16, comm.rank + 1, dtype=np.float32)
comm.allreduce(x)
want = comm.size * (comm.size + 1) / 2
print(json.dumps({"transport": comm.transport, "ok": bool((x == want).all()), "size": comm.size}), flush=True)
group.leave(finished=True)
