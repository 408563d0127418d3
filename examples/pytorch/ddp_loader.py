#!/usr/bin/env python3
"""The DDP training step on the digits model with a ``DataLoader(num_workers=N)``, on cohort or
on gloo, quiet or beside CPU-bound neighbours: the busy-cores figure of docs/benchmarks.md.

Model, data, global batch and optimizer are those of digits.py (and of the gloo reference,
../../../shared/peers/ddp_digits.py). Each rank reads its slice of every global batch through a
``DataLoader`` with ``num_workers`` worker processes (the neighbours a real training job has:
they decode, collate and prefetch while the rank computes and reduces), and steps through
``DistributedDataParallel`` on the chosen backend.

    # one job: WORLD rank processes on gloo (file rendezvous) or on cohort (a coordinator on a
    # free loopback port), LOAD extra CPU-bound processes beside them
    python examples/pytorch/ddp_loader.py --backend cohort --world 2 --loader-workers 2 --load 2

Prints one line for the job (from rank 0):
    peer=BACKEND world=W loader_workers=K load=L steps=S step_ms_median=T iter_ms_median=I
        test_accuracy=A param_sha256=H
``step_ms`` times forward, backward (with DDP's bucketed allreduce) and the optimizer step, as
the reference does; ``iter_ms`` adds the wait for the loader's next batch.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))


def rank_main(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from digits import GLOBAL_BATCH, accuracy, data, digest, epoch_order, model

    torch.set_num_threads(1)
    if args.backend == "gloo":
        dist.init_process_group("gloo", init_method=f"file://{args.init_file}", rank=args.rank, world_size=args.world)
        rank, world, closer = args.rank, args.world, None
    else:
        import cohort
        import cohort.torch

        group = cohort.Group(args.job, args.coordinator, f"w{args.rank}")
        comm = group.next_generation()
        cohort.torch.init_process_group(comm)
        rank, world, closer = comm.rank, comm.size, (group, comm)

    (xtr, ytr), (xte, yte) = data(args.seed)
    net = model(args.hidden, args.seed)
    ddp = torch.nn.parallel.DistributedDataParallel(net)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    lo, hi = rank * GLOBAL_BATCH // world, (rank + 1) * GLOBAL_BATCH // world

    def batches(epoch: int) -> list[list[int]]:
        order = epoch_order(args.seed, epoch, len(xtr))
        return [order[s + lo : s + hi].tolist() for s in range(0, len(order) - GLOBAL_BATCH + 1, GLOBAL_BATCH)]

    dataset = torch.utils.data.TensorDataset(xtr, ytr)
    step_times: list[float] = []
    iter_times: list[float] = []
    for epoch in range(args.epochs):
        loader = torch.utils.data.DataLoader(dataset, batch_sampler=batches(epoch), num_workers=args.loader_workers)
        t_iter = time.perf_counter()
        for x, y in loader:
            t0 = time.perf_counter()
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(ddp(x), y)
            loss.backward()
            opt.step()
            t1 = time.perf_counter()
            step_times.append(t1 - t0)
            iter_times.append(t1 - t_iter)
            t_iter = t1
    # The first epoch's first steps include the loader's start-up; the medians ignore it.
    if rank == 0:
        print(
            f"peer={args.backend} world={world} loader_workers={args.loader_workers} load={args.load} "
            f"steps={len(step_times)} step_ms_median={statistics.median(step_times) * 1e3:.3f} "
            f"iter_ms_median={statistics.median(iter_times) * 1e3:.3f} "
            f"test_accuracy={accuracy(net, xte, yte):.4f} param_sha256={digest(net)}",
            flush=True,
        )
    dist.destroy_process_group()
    if closer:
        group, comm = closer
        comm.close()
        group.leave(finished=True)


def job_main(args: argparse.Namespace) -> int:
    hogs = [subprocess.Popen([sys.executable, "-c", "while 1: pass"]) for _ in range(args.load)]
    coord = None
    try:
        with tempfile.TemporaryDirectory() as tmp:
            extra: list[str] = []
            if args.backend == "cohort":
                from run_local import start_coordinator

                coord, endpoint = start_coordinator(args.world, Path(tmp) / "coordinator.log")
                extra = ["--coordinator", endpoint, "--job", f"ddp-loader-{os.getpid()}"]
            else:
                extra = ["--init-file", str(Path(tmp) / "init")]
            common = [
                *("--backend", args.backend, "--world", str(args.world)),
                *("--loader-workers", str(args.loader_workers), "--epochs", str(args.epochs)),
                *("--load", str(args.load), "--hidden", str(args.hidden), "--seed", str(args.seed)),
                *extra,
            ]
            ranks = [
                subprocess.Popen([sys.executable, "-u", __file__, "--rank", str(r)] + common) for r in range(args.world)
            ]
            deadline = time.monotonic() + args.timeout
            failed = 0
            for p in ranks:
                try:
                    failed |= p.wait(timeout=max(1.0, deadline - time.monotonic())) != 0
                except subprocess.TimeoutExpired:
                    for q in ranks:
                        q.kill()
                    raise SystemExit(f"the job did not finish in {args.timeout} s") from None
            return 1 if failed else 0
    finally:
        for h in hogs:
            h.kill()
        if coord is not None:
            coord.kill()
            coord.wait(timeout=10)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", choices=["cohort", "gloo"], default="cohort")
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--loader-workers", type=int, default=2, help="DataLoader worker processes per rank")
    ap.add_argument("--load", type=int, default=0, help="CPU-bound processes started beside the job")
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--timeout", type=float, default=600.0, help="the whole job's deadline, seconds")
    ap.add_argument("--rank", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--coordinator", help=argparse.SUPPRESS)
    ap.add_argument("--job", help=argparse.SUPPRESS)
    ap.add_argument("--init-file", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.rank is not None:
        rank_main(args)
    else:
        sys.exit(job_main(args))


if __name__ == "__main__":
    main()
