"""A rank of a gloo job that rendezvous through cohort.torch.Store (the coordinator's store),
not a TCPStore: ``store_gloo.py ENDPOINT JOB TOKEN RANK WORLD SCOPE``. Runs an allreduce and a
barrier, prints ``ok rank=R sum=S`` and the store's view of its keys."""

import sys
from datetime import timedelta

import torch
import torch.distributed as dist

import cohort
import cohort.torch

endpoint, job, token, rank, world, scope = sys.argv[1:7]
rank, world = int(rank), int(world)
store = cohort.torch.Store(job, endpoint, token=token, scope=scope, timeout=timedelta(seconds=60))
print(f"cohort from {cohort.__file__}", flush=True)
dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=60))
t = torch.full((1000,), float(rank + 1))
dist.all_reduce(t)
dist.barrier()
expected = world * (world + 1) / 2
assert torch.all(t == expected), t
print(f"ok rank={rank} sum={t[0].item():g} keys={store.num_keys()}", flush=True)
dist.destroy_process_group()
