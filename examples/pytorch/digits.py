#!/usr/bin/env python3
"""Data-parallel training of a small network on a real data set, elastic, on cohort.

The model, data and settings of ../../../shared/peers/ddp_digits.py (the gloo DDP reference):
scikit-learn's bundled digits data set (no download; 1500 training and 297 test images),
an MLP 64-1024-1024-10, global batch 64, SGD (lr 0.05, momentum 0.9), 10 epochs, seed 1.

Each step every rank takes its slice of the same global batch (the seeded permutation of the
epoch), so the job computes the same global-batch gradient whatever the world; a commit
after every step holds the model, the optimizer and the position (epoch, step). When a rank
dies, the survivors restore the last commit, re-form with the replacement, sync it, and go on
from the same step: the final parameters do not depend on the failures.

    python examples/pytorch/digits.py --coordinator http://127.0.0.1:7470 --job digits --worker-id w0
    python examples/pytorch/digits.py ... --ddp      # the same through DistributedDataParallel
                                                     # on the "cohort" torch.distributed backend
    python examples/pytorch/digits.py ... --managed  # DDP on torch's gloo, cohort's membership
                                                     # (cohort.torch.managed)
    python examples/pytorch/digits.py --world 1      # one process, no cohort (the baseline)

Prints ``event=...`` progress lines and at the end (rank 0 of the last generation):
    event=summary world=N steps=S step_ms_median=T test_accuracy=A final_loss=L param_sha256=H reformations=R
(``param_sha256`` and the accuracy on every rank with --all-ranks-summary).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import statistics
import sys
import time
from typing import Optional

import torch
from sklearn.datasets import load_digits

GLOBAL_BATCH = 64


def data(seed: int) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """The reference's split: a seeded permutation, 1500 for training, the rest for testing."""
    d = load_digits()
    x = torch.tensor(d.data / 16.0, dtype=torch.float32)
    y = torch.tensor(d.target, dtype=torch.long)
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(len(x), generator=g)
    x, y = x[perm], y[perm]
    return (x[:1500], y[:1500]), (x[1500:], y[1500:])


def model(hidden: int, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(64, hidden),
        torch.nn.ReLU(),
        torch.nn.Linear(hidden, hidden),
        torch.nn.ReLU(),
        torch.nn.Linear(hidden, 10),
    )


def epoch_order(seed: int, epoch: int, n: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 1000 + epoch)
    return torch.randperm(n, generator=g)


def digest(net: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for p in net.parameters():
        h.update(p.detach().numpy().tobytes())
    return h.hexdigest()[:16]


def accuracy(net: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    with torch.no_grad():
        return (net(x).argmax(1) == y).float().mean().item()


def emit(event: str, /, *, extra: Optional[dict[str, object]] = None, **fields: object) -> None:
    """Prints an event line through the package's formatter (the keys of the worker protocol,
    checked against the Rust definitions; this example's own in ``extra``)."""
    from cohort.events import emit as emit_line

    emit_line(event, extra=extra, **fields)


def single_process(args: argparse.Namespace) -> None:
    """The fault-free single-process baseline with the same global batch."""
    (xtr, ytr), (xte, yte) = data(args.seed)
    net = model(args.hidden, args.seed)
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    times, loss = [], torch.tensor(0.0)
    for epoch in range(args.epochs):
        order = epoch_order(args.seed, epoch, len(xtr))
        for start in range(0, len(order) - GLOBAL_BATCH + 1, GLOBAL_BATCH):
            idx = order[start : start + GLOBAL_BATCH]
            t0 = time.perf_counter()
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(net(xtr[idx]), ytr[idx])
            loss.backward()
            opt.step()
            times.append(time.perf_counter() - t0)
    emit(
        "summary",
        extra=dict(
            world=1,
            steps=len(times),
            step_ms_median=f"{statistics.median(times) * 1e3:.3f}",
            test_accuracy=f"{accuracy(net, xte, yte):.4f}",
            final_loss=f"{loss.item():.4f}",
            param_sha256=digest(net),
            reformations=0,
        ),
    )


def elastic(args: argparse.Namespace) -> None:
    import cohort
    import cohort.elastic
    import cohort.torch
    import cohort.torch.managed

    token = open(args.token_file).read().strip() if args.token_file else None
    config = cohort.GroupConfig(
        args.job,
        args.coordinator,
        args.worker_id,
        token=token,
        listen=args.listen,
        advertise=args.advertise,
        no_progress_timeout=args.no_progress_timeout,
        coordinator_wait=args.coordinator_wait,
    )
    group = cohort.Group(config)
    (xtr, ytr), (xte, yte) = data(args.seed)
    net = model(args.hidden, args.seed)
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    state = cohort.elastic.TorchState(group, model=net, optimizer=opt, epoch=0, step_in_epoch=0, steps=0)
    steps_per_epoch = len(xtr) // GLOBAL_BATCH
    times: list[float] = []
    # Everything in the state must be the same on every rank (its digest is compared at each
    # sync): the loss of this rank's slice is not, so it is kept outside.
    trainer: dict[str, object] = {"loss": 0.0}

    def on_reform() -> None:
        # Mean loss and average when the batch splits evenly (what DDP computes); else a
        # loss scaled by the global batch and a sum, so any world computes the same mean.
        even = GLOBAL_BATCH % state.size == 0
        if args.managed:
            # torch's own gloo for this generation's ranks, cohort's membership (cohort.torch.managed).
            cohort.torch.managed.init_process_group(state)
            trainer["ddp"] = torch.nn.parallel.DistributedDataParallel(net)
        elif args.ddp:
            cohort.torch.init_process_group(state)
            trainer["ddp"] = torch.nn.parallel.DistributedDataParallel(net)
        else:
            if "averager" in trainer:
                trainer["averager"].remove()
            trainer["averager"] = cohort.torch.GradientAverager(
                net, state, bucket_bytes=args.bucket_bytes, op="avg" if even else "sum"
            )
        trainer["even"] = even
        backend = torch.distributed.get_backend() if args.ddp else "api"
        emit(
            "generation",
            gen=state.generation,
            world=state.size,
            rank=state.rank,
            extra=dict(step=state.steps, backend=backend),
        )

    state.register_reset_callbacks([on_reform])
    state.register_failure_callbacks(
        [
            lambda e: emit(
                "error",
                gen=e.generation,
                kind=type(e).__name__,
                cause=str(e.cause),
                extra=dict(cause_worker=e.worker_id or "-"),
            )
        ]
    )

    @cohort.elastic.run
    def train(state: cohort.elastic.TorchState) -> None:
        world, rank = state.size, state.rank
        lo, hi = rank * GLOBAL_BATCH // world, (rank + 1) * GLOBAL_BATCH // world
        if args.ddp and not trainer["even"]:
            raise SystemExit(f"--ddp needs a world that divides the global batch {GLOBAL_BATCH} (world {world})")
        forward = trainer["ddp"] if args.ddp else net
        while state.epoch < args.epochs:
            order = epoch_order(args.seed, state.epoch, len(xtr))
            while state.step_in_epoch < steps_per_epoch:
                start = state.step_in_epoch * GLOBAL_BATCH
                idx = order[start + lo : start + hi]
                t0 = time.perf_counter()
                opt.zero_grad()
                out = forward(xtr[idx])
                if trainer["even"]:
                    loss = torch.nn.functional.cross_entropy(out, ytr[idx])
                else:
                    loss = torch.nn.functional.cross_entropy(out, ytr[idx], reduction="sum") / GLOBAL_BATCH
                emit("allreduce", gen=state.generation, rank=rank, step=state.steps)
                loss.backward()
                if not args.ddp:
                    trainer["averager"].synchronize()
                opt.step()
                times.append(time.perf_counter() - t0)
                state.step_in_epoch += 1
                state.steps += 1
                trainer["loss"] = loss.item()
                emit(
                    "step",
                    gen=state.generation,
                    world=world,
                    rank=rank,
                    step=state.steps,
                    extra=dict(loss=f"{trainer['loss']:.4f}"),
                )
                if state.steps % args.commit_every == 0 or state.step_in_epoch == steps_per_epoch:
                    state.commit(step=state.steps)
            state.epoch += 1
            state.step_in_epoch = 0
        # The final model's digest, agreed by every rank (a last check that nothing diverged).
        mine = torch.tensor(list(bytes.fromhex(digest(net))), dtype=torch.uint8)
        every = torch.empty(len(mine) * world, dtype=torch.uint8)
        state.comm.allgather(mine, every)
        agreed = all(
            bytes(every[r * len(mine) : (r + 1) * len(mine)].tolist()) == bytes(mine.tolist()) for r in range(world)
        )
        if rank == 0 or args.all_ranks_summary:
            emit(
                "summary",
                extra=dict(
                    world=world,
                    steps=state.steps,
                    step_ms_median=f"{statistics.median(times) * 1e3:.3f}" if times else "nan",
                    test_accuracy=f"{accuracy(net, xte, yte):.4f}",
                    final_loss=f"{trainer['loss']:.4f}",
                    param_sha256=digest(net),
                    reformations=state.reformations,
                    ranks_agree=agreed,
                    rank=rank,
                ),
            )
        if not agreed:
            raise SystemExit("the ranks' final parameters differ")

    train(state)


def main(argv: Optional[list[str]] = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--coordinator", help="coordinator endpoints (comma separated)")
    ap.add_argument(
        "--coordinator-wait",
        type=float,
        default=3.0,
        help="seconds to retry a first contact while every endpoint refuses (a wrong address)",
    )
    ap.add_argument("--job", default="digits")
    ap.add_argument("--worker-id", default=None)
    ap.add_argument("--token-file", default=None)
    ap.add_argument("--listen", default="0.0.0.0:0")
    ap.add_argument("--advertise", default="127.0.0.1")
    ap.add_argument("--no-progress-timeout", type=float, default=10.0)
    ap.add_argument("--world", type=int, default=None, help="1: train in this process without cohort")
    ap.add_argument("--ddp", action="store_true", help="DistributedDataParallel on the cohort backend")
    ap.add_argument(
        "--managed",
        action="store_true",
        help="DistributedDataParallel on torch's gloo managed by cohort (cohort.torch.managed); implies --ddp",
    )
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--commit-every", type=int, default=1, help="commit every N steps (and at each epoch's end)")
    ap.add_argument("--bucket-bytes", type=int, default=4 << 20)
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (the reference uses 1)")
    ap.add_argument("--all-ranks-summary", action="store_true", help="every rank prints the summary line")
    args = ap.parse_args(argv)
    args.ddp = args.ddp or args.managed
    torch.set_num_threads(args.threads)
    if args.world == 1:
        single_process(args)
        return
    if not args.coordinator:
        ap.error("--coordinator is required (or --world 1)")
    if args.worker_id is None:
        args.worker_id = f"{os.uname().nodename}-{os.getpid()}"
    elastic(args)


if __name__ == "__main__":
    sys.exit(main())
