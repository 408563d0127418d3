"""A worker for torch's fault-tolerance hooks on the "cohort" backend (torch 2.x): the world
group survives a rank's replacement through ``dist._reconfigure``, with no new process group.

argv: COORDINATOR JOB WORKER_ID. Joins, runs one all_reduce, prints ``ready GEN RANK``; then
loops all_reduces until one fails (a peer was killed), re-forms through cohort, reconfigures
the same torch group to the new generation with the handles every rank gathered
(``dist._get_reconfigure_handle``; every rank calls ``dist._reconfigure``, a collective),
checks an all_reduce over it, and that handles naming a stranger or in another order raise on
every rank, printing ``reconfigured GEN RANK``. A worker that joins a generation after the
first (the replacement) goes to the reconfigure at once. Each rank's input is rank + 1, so the sum says
which ranks took part.
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
if state.comm.generation == 1:  # a replacement goes to the reconfigure at once, as its peers do
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
handles = [None] * state.comm.size
dist.all_gather_object(handles, dist._get_reconfigure_handle())
assert handles[state.comm.rank] == worker_id, handles
assert dist._reconfigure(state.comm.generation, handles).wait()
assert dist.group.WORLD is pg
assert summed() == want, "the all_reduce after reconfigure"
# Handles that do not match the generation raise on every rank (its own place is right on most).
for wrong, says in (([*handles[:-1], "stranger"], "stranger"), (handles[::-1], "rank order")):
    try:
        dist._reconfigure(state.comm.generation, wrong).wait()
    except Exception as e:  # noqa: BLE001 - the message is what is checked
        assert says in str(e), e
    else:
        raise AssertionError(f"reconfigure to {wrong} did not raise")
assert summed() == want, "the all_reduce after the refused reconfigures"
print(f"reconfigured {state.comm.generation} {state.comm.rank}", flush=True)
dist.destroy_process_group()
state.comm.close()
group.leave(finished=True)
