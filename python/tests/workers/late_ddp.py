"""DDP on the "cohort" backend with a rank that checkpoints between steps. argv: COORDINATOR
JOB WORKER_ID SECONDS CHECKPOINT_DIR.

Every setting at its default: two steps, then rank 0 saves its model (`torch.save`) and keeps
"saving" for SECONDS (a sleep: a slow storage write) while rank 1 goes on into the next
step's gradient allreduce; then two more steps. Prints `done` with the generation and a
digest of the parameters (equal on every rank), or raises (exit status 1).
"""

import hashlib
import json
import os
import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import cohort
import cohort.torch

coordinator, job, worker_id, seconds, checkpoint_dir = sys.argv[1:6]
seconds = float(seconds)
group = cohort.Group(job, coordinator, worker_id)
comm = group.next_generation()
generation = comm.generation
cohort.torch.init_process_group(comm)
rank = dist.get_rank()
torch.manual_seed(0)
model = DDP(torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4)))
opt = torch.optim.SGD(model.parameters(), lr=0.1)


def step(n: int) -> float:
    g = torch.Generator().manual_seed(1000 * n + rank)
    x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
    t0 = time.monotonic()
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    took = time.monotonic() - t0
    print(json.dumps({"event": "step", "worker": worker_id, "step": n, "took": took}), flush=True)
    return took


for n in range(2):
    step(n)
if rank == 0:
    torch.save(model.module.state_dict(), os.path.join(checkpoint_dir, "model.pt"))
    time.sleep(seconds)
waited = step(2)
step(3)
digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest()
done = {"event": "done", "worker": worker_id, "rank": rank, "waited": waited}
print(json.dumps({**done, "generation": generation, "digest": digest}), flush=True)
dist.destroy_process_group()
group.leave(finished=True)
