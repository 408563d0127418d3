"""CUDA tensors on the cohort backend, one rank of a job whose ranks share one GPU:
``cuda_collectives.py ENDPOINT JOB WORKER_ID``. Checks all_reduce (float32 and bfloat16, one
chunk and several), all_reduce_coalesced, broadcast and DDP on CUDA tensors against their exact
values, that what is not staged is refused, then times all_reduce on CUDA tensors beside the
same on host tensors. Prints ``ok ...`` lines, one JSON line per timing
(``{"event": "timing", ...}``), a ``{"event": "ddp", ...}`` line, then ``done``."""

import hashlib
import json
import sys
import time

import torch
import torch.distributed as dist

import cohort
import cohort.elastic
import cohort.torch
from cohort.torch import cuda as staging

endpoint, job, worker_id = sys.argv[1:4]
group = cohort.Group(job, endpoint, worker_id)
state = cohort.elastic.ObjectState(group, step=0)
state.reform()
cohort.torch.init_process_group(state)
rank, size = dist.get_rank(), dist.get_world_size()
dev = torch.device("cuda", 0)
torch.cuda.set_device(dev)
ranks_sum = size * (size - 1) // 2

# all_reduce: one chunk and several (CHUNK_BYTES is 4 MiB unless set), float32 and bfloat16.
for dtype, n, mod in (
    (torch.float32, 1, 97),
    (torch.float32, 1000, 97),
    (torch.float32, 3_000_001, 97),
    (torch.bfloat16, 1000, 7),
    (torch.bfloat16, 5_000_000, 7),
):
    base = torch.arange(n, device=dev, dtype=torch.int64) % mod
    t = (base + rank).to(dtype)
    expected = (base * size + ranks_sum).to(dtype)
    # The producing kernel is still queued on the stream: the copy down must wait for it.
    t.mul_(1)
    dist.all_reduce(t)
    assert t.device == dev, t.device
    assert torch.equal(t, expected), (dtype, n, (t - expected).abs().max())
    chunks = len(staging.chunks(n, t.element_size(), staging.CHUNK_BYTES))
    print(f"ok all_reduce {dtype} n={n} chunks={chunks}", flush=True)

# Several tensors in flight at once (async), completed in order, then max.
ts = [torch.full((k * 100_000 + 1,), float(rank + k), device=dev) for k in range(4)]
works = [dist.all_reduce(t, async_op=True) for t in ts]
for w in works:
    w.wait()
for k, t in enumerate(ts):
    assert torch.all(t == float(size * k + ranks_sum)), k
m = torch.full((10,), float(rank), device=dev)
dist.all_reduce(m, op=dist.ReduceOp.MAX)
assert torch.all(m == size - 1)
print("ok all_reduce async x4 and max", flush=True)

# broadcast from the last rank: its tensor is copied down only, the others' up only.
b = torch.full((2_500_000,), float(rank), device=dev)
dist.broadcast(b, src=size - 1)
assert torch.all(b == size - 1)
print("ok broadcast", flush=True)

# all_gather into a list (through host memory whole; DDP checks parameter shapes with it).
outs = [torch.empty(3, device=dev) for _ in range(size)]
dist.all_gather(outs, torch.full((3,), float(rank), device=dev))
assert all(torch.all(o == r) for r, o in enumerate(outs)), outs
print("ok all_gather list", flush=True)

# What is not staged is refused, naming what is.
try:
    dist.all_gather_into_tensor(torch.empty(size * 4, device=dev), torch.ones(4, device=dev))
except Exception as e:  # noqa: BLE001 - torch may wrap the backend's error
    assert "staged through host memory" in str(e), e
    print("ok all_gather on CUDA refused", flush=True)
else:
    raise SystemExit("all_gather_into_tensor on CUDA tensors was not refused")

# DDP on the GPU: the parameters start apart and end equal on every rank.
torch.manual_seed(1234 + rank)
model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 10)).to(dev)
ddp = torch.nn.parallel.DistributedDataParallel(model)
opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
torch.manual_seed(99)
data = [(torch.randn(64, 256, device=dev), torch.randint(0, 10, (64,), device=dev)) for _ in range(size * 5)]
for step in range(5):
    x, y = data[step * size + rank]
    opt.zero_grad()
    torch.nn.functional.cross_entropy(ddp(x), y).backward()
    opt.step()
digest = hashlib.sha256(b"".join(p.detach().cpu().numpy().tobytes() for p in model.parameters())).hexdigest()
print(json.dumps({"event": "ddp", "rank": rank, "param_sha256": digest}), flush=True)

# Timing: all_reduce of float32 on CUDA (staged) beside the same bytes on host memory.
for nbytes, iters in ((4 << 10, 200), (1 << 20, 100), (16 << 20, 20), (64 << 20, 10)):
    n = nbytes // 4
    host = torch.zeros(n)
    gpu = torch.zeros(n, device=dev)
    best = {}
    for kind, t in (("host", host), ("cuda", gpu), ("host", host), ("cuda", gpu)):
        for _ in range(2):
            dist.all_reduce(t)
        torch.cuda.synchronize()
        dist.barrier()
        start = time.perf_counter()
        for _ in range(iters):
            dist.all_reduce(t)
        torch.cuda.synchronize()
        us = (time.perf_counter() - start) / iters * 1e6
        best[kind] = min(best.get(kind, float("inf")), us)
    print(
        json.dumps(
            {
                "event": "timing",
                "rank": rank,
                "ranks": size,
                "bytes": nbytes,
                "iters": iters,
                "host_us": round(best["host"], 1),
                "cuda_us": round(best["cuda"], 1),
                "cuda_over_host": round(best["cuda"] / best["host"], 2),
            }
        ),
        flush=True,
    )

dist.barrier()
dist.destroy_process_group()
group.leave(finished=True)
print("done", flush=True)
