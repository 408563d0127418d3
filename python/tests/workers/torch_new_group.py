"""A worker that makes torch.distributed groups on the "cohort" backend at 3 ranks.

argv: COORDINATOR JOB WORKER_ID. `new_group([0, 1])`: on torch 2.x a subgroup whose members
all-reduce over it (rank 2 is not a member); on torch 1.13, where a cohort group spans the whole
generation, every rank raises the same error (prints `refused: MESSAGE`), the non-member too (it
used to wait forever in 1.13's store barrier). Then `new_group()` over every rank works on both.
Prints `done` at the end.
"""

import sys

import torch
import torch.distributed as dist

import cohort
import cohort.torch

coordinator, job, worker_id = sys.argv[1:4]
group = cohort.Group(job, coordinator, worker_id, no_progress_timeout=20.0)
comm = group.next_generation()
rank, size = comm.rank, comm.size
cohort.torch.init_process_group(comm)
print(f"ok register torch={torch.__version__} rank={rank}", flush=True)

try:
    pair = dist.new_group([0, 1])
except RuntimeError as e:
    print(f"refused: {e}", flush=True)
else:
    if rank < 2:
        t = torch.full((4,), float(rank + 1))
        dist.all_reduce(t, group=pair)
        assert torch.equal(t, torch.full((4,), 3.0)), t
        print("ok subgroup all_reduce", flush=True)
    else:
        print(f"not a member: {pair is dist.GroupMember.NON_GROUP_MEMBER}", flush=True)

everyone = dist.new_group()
t = torch.full((4,), float(rank + 1))
dist.all_reduce(t, group=everyone)
assert torch.equal(t, torch.full((4,), float(sum(range(1, size + 1))))), t
print("ok whole-world new_group", flush=True)
print("done", flush=True)
# As every torch program here ends (examples/pytorch/*.py); left to the interpreter's exit,
# a 1.13 process was seen aborting ("terminate called without an active exception").
dist.destroy_process_group()
comm.close()
group.leave(finished=True)
