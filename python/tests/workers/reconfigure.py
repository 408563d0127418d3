"""A worker for torch's fault-tolerance hooks on the "cohort" backend (torch 2.x): the world
group survives a rank's replacement through ``dist._reconfigure``, with no new process group.

argv: COORDINATOR JOB WORKER_ID. Joins, runs one all_reduce, prints ``ready GEN RANK``; then loops
all_reduces until one fails (a peer was killed), re-forms through cohort, reconfigures the
same torch group to the new generation and checks an all_reduce over it, printing
``reconfigured GEN RANK``. A worker that joins a generation after the first (the replacement)
runs the check at once. Each rank's input is rank + 1, so the sum says which ranks took part.
"""

import sys
from types import SimpleNamespace

import torch
import torch.distributed as dist

import cohort
import cohort.torch

coordinator, job, worker_id = sys.argv[1:4]
group = cohort.Group(job, coordinator, worker_id, no_progress_timeout=10.0)
state = SimpleNamespace(comm=group.next_generation())
pg = cohort.torch.init_process_group(state)


def summed() -> float:
    t = torch.tensor([float(state.comm.rank + 1)])
    dist.all_reduce(t)
    return t.item()


want = sum(range(1, state.comm.size + 1))
assert summed() == want
print(f"ready {state.comm.generation} {state.comm.rank}", flush=True)
if state.comm.generation == 1:
    while True:
        try:
            got = summed()
            assert got == want, f"got {got}"
        except cohort.CollectiveError:
            break
        except RuntimeError as e:  # torch may re-raise the backend's error as its own
            if "cohort" not in str(e) and "peer" not in str(e):
                raise
            break
    state.comm.close()
    state.comm = group.next_generation()
    handles = [m.worker_id for m in state.comm.members]
    assert dist._reconfigure(state.comm.generation, handles).wait()
    assert dist.group.WORLD is pg
    assert summed() == want, "the all_reduce after reconfigure"
print(f"reconfigured {state.comm.generation} {state.comm.rank}", flush=True)
dist.destroy_process_group()
state.comm.close()
group.leave(finished=True)
