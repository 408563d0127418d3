"""A rank that exits with a managed gloo call in flight: ``managed_exit.py ENDPOINT JOB WORKER``,
on a job of two workers (cohort.torch.managed, cohort.elastic.ObjectState).

Rank 0 starts an ``all_reduce(async_op=True)`` and ends its script without waiting for it
(``{"event": "exiting"}``): its exit must wait for the call (cohort.torch.managed drains gloo's
work in flight at exit, so that gloo's thread never completes it during the interpreter's
finalization). Rank 1 joins the call only once the test closes its stdin, then prints the sum
(``{"event": "summed", "values": [...]}``).
"""

import json
import sys

import torch
import torch.distributed as dist

import cohort
import cohort.elastic
import cohort.torch.managed as managed

endpoint, job, worker = sys.argv[1:4]


def report(kind: str, **facts) -> None:
    print(json.dumps({"event": kind, "worker": worker, **facts}), flush=True)


group = cohort.Group(job, endpoint, worker)
state = cohort.elastic.ObjectState(group, step=0)
state.reform()
managed.init_process_group(state, timeout=60)
t = torch.full((4,), float(state.rank + 1))
report("ready", rank=state.rank)
if state.rank == 0:
    dist.all_reduce(t, async_op=True)
    report("exiting")
else:
    sys.stdin.read()  # the test's cue: rank 0 is in its exit, waiting for this call
    dist.all_reduce(t)
    report("summed", values=t.tolist())
