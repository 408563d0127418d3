#!/usr/bin/env python3
"""FSDP2 (``fully_shard``) on a DeviceMesh, on cohort or on gloo (torch 2.x): one-dimensional
(FSDP), or with ``--replicas R`` two-dimensional, R replica groups of world/R shards (HSDP).

The model, data and settings of digits.py (scikit-learn's digits, MLP 64-1024-1024-10, global
batch 64, SGD lr 0.05 momentum 0.9, seed 1): every Linear and the root are sharded with
``fully_shard`` over ``init_device_mesh("cpu", (world,))`` (or, with ``--replicas R``, over
``init_device_mesh("cpu", (R, world // R), mesh_dim_names=("replicate", "shard"))``: each
replica group of world/R ranks holds one sharded copy, and gradients are reduce-scattered within
it and all-reduced across the groups); each step every rank takes its slice of the same global
batch. The training code is the same for both backends; only the start
differs:

    # cohort: a coordinator forms the job (its size is the world)
    cohort-coordinator serve --listen 127.0.0.1:7470 --min-workers 2 --max-workers 2 &
    python examples/pytorch/fsdp2.py --coordinator http://127.0.0.1:7470 --job fsdp --worker-id w0 &
    python examples/pytorch/fsdp2.py --coordinator http://127.0.0.1:7470 --job fsdp --worker-id w1

    # torch's gloo, managed by cohort (cohort.torch.managed): the same, with --managed
    python examples/pytorch/fsdp2.py --coordinator http://127.0.0.1:7470 --job fsdp --worker-id w0 --managed &

    # gloo, as torchrun would start it (a shared file as the rendezvous)
    python examples/pytorch/fsdp2.py --gloo /tmp/fsdp-init --rank 0 --world 2 &
    python examples/pytorch/fsdp2.py --gloo /tmp/fsdp-init --rank 1 --world 2

Prints, on every rank, at the end (through ``cohort.events``; B is ``cohort``, ``cohort_gloo``
with ``--managed``, or ``gloo``):
    event=summary backend=B world=N replicas=R steps=S step_ms_median=T test_accuracy=A param_sha256=H t_ms=T
where ``param_sha256`` hashes the full (unsharded) parameters, gathered with
``DTensor.full_tensor()``. Not elastic: a failure ends the run (sharded state is not a
cohort commit yet; see docs/python.md).
"""

from __future__ import annotations

import argparse
import hashlib
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from digits import GLOBAL_BATCH, data, epoch_order, model  # noqa: E402 - the same model and data


def start(args: argparse.Namespace) -> tuple[int, int, str]:
    """Joins the job (cohort) or the file rendezvous (gloo): (rank, world, backend)."""
    if args.gloo:
        dist.init_process_group("gloo", init_method=f"file://{args.gloo}", rank=args.rank, world_size=args.world)
        return args.rank, args.world, "gloo"
    import cohort
    import cohort.torch

    group = cohort.Group(cohort.GroupConfig(args.job, args.coordinator, args.worker_id))
    comm = group.next_generation()
    args._cohort = (group, comm)
    if args.managed:
        from types import SimpleNamespace

        import cohort.torch.managed

        # torch's gloo for this generation's ranks, with cohort's membership and root cause.
        cohort.torch.managed.init_process_group(SimpleNamespace(group=group, comm=comm))
        return comm.rank, comm.size, cohort.torch.managed.BACKEND
    cohort.torch.init_process_group(comm)
    return comm.rank, comm.size, "cohort"


def finish(args: argparse.Namespace) -> None:
    dist.destroy_process_group()
    if not args.gloo:
        group, comm = args._cohort
        comm.close()
        group.leave(finished=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--coordinator")
    ap.add_argument("--job", default="fsdp")
    ap.add_argument("--worker-id")
    ap.add_argument("--gloo", metavar="INIT_FILE", help="run on gloo with this file as the rendezvous")
    ap.add_argument(
        "--managed",
        action="store_true",
        help="with --coordinator: on torch's gloo managed by cohort (cohort.torch.managed), not the cohort backend",
    )
    ap.add_argument("--rank", type=int, default=0)
    ap.add_argument("--world", type=int, default=1)
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--max-steps", type=int, default=0, help="stop after this many steps (0: every epoch)")
    ap.add_argument("--replicas", type=int, default=1, help="replica groups (HSDP when more than 1)")
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--save", metavar="PATH", help="rank 0 saves the full parameters here (torch.save, a list)")
    args = ap.parse_args()
    torch.set_num_threads(1)

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    rank, world, backend = start(args)
    if args.replicas < 1 or world % args.replicas:
        raise SystemExit(f"--replicas {args.replicas} does not divide the world of {world}")
    if args.replicas == 1:
        mesh = init_device_mesh("cpu", (world,))
    else:
        mesh = init_device_mesh("cpu", (args.replicas, world // args.replicas), mesh_dim_names=("replicate", "shard"))
    (xtr, ytr), (xte, yte) = data(args.seed)
    net = model(args.hidden, args.seed)
    for layer in net:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(net, mesh=mesh)
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    per_rank = GLOBAL_BATCH // world
    times: list[float] = []
    for epoch in range(args.epochs):
        order = epoch_order(args.seed, epoch, len(xtr))
        for start_at in range(0, len(order) - GLOBAL_BATCH + 1, GLOBAL_BATCH):
            if args.max_steps and len(times) == args.max_steps:
                break
            idx = order[start_at + rank * per_rank : start_at + (rank + 1) * per_rank]
            t0 = time.perf_counter()
            opt.zero_grad()
            torch.nn.functional.cross_entropy(net(xtr[idx]), ytr[idx]).backward()
            opt.step()
            times.append(time.perf_counter() - t0)
    with torch.no_grad():
        acc = (net(xte).argmax(1) == yte).float().mean().item()
    h = hashlib.sha256()
    for p in net.parameters():
        h.update(p.full_tensor().detach().numpy().tobytes())
    from cohort.events import emit

    emit(
        "summary",
        extra=dict(
            backend=backend,
            world=world,
            replicas=args.replicas,
            steps=len(times),
            step_ms_median=f"{statistics.median(times) * 1e3:.3f}",
            test_accuracy=f"{acc:.4f}",
            param_sha256=h.hexdigest()[:16],
        ),
    )
    finish(args)


if __name__ == "__main__":
    main()
