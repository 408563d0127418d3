"""Worker for the managed-gloo world tests (test_managed.py): DDP on torch's gloo managed by
cohort (``cohort.torch.managed``), elastic (``cohort.elastic.run``, a commit every step), on a
small model, so that worlds of 3 or more ranks fit the test machine's cores.

argv: COORDINATOR JOB WORKER_ID [--steps N] [--hold-at K]

--hold-at K: in its first generation, at step K, after the forward pass, this rank prints
``{"event": "holding", ...}`` and blocks reading stdin until it is closed: the other ranks
are then inside DDP's allreduce, waiting for it, when the test kills or stops it. A rank that
was held and is let go again (SIGCONT, stdin closed) finds its generation revoked and goes on
as any member does (re-forms, or is told the job finished).

Prints JSON lines: ``joined``, ``generation`` (per formation), ``error`` (each failure, with
its root cause), ``done`` (steps, reformations, the parameters' sha256), ``spare`` (a process
the job finished without).
"""

import argparse
import hashlib
import json
import sys

import torch

import cohort
import cohort.elastic
import cohort.torch.managed

ap = argparse.ArgumentParser()
ap.add_argument("coordinator")
ap.add_argument("job")
ap.add_argument("worker_id")
ap.add_argument("--steps", type=int, default=30)
ap.add_argument("--hold-at", type=int, default=-1)
args = ap.parse_args()
torch.set_num_threads(1)

BATCH = 12  # rows per step, split evenly over 2, 3 or 4 ranks


def report(kind: str, **facts) -> None:
    print(json.dumps({"event": kind, "worker": args.worker_id, **facts}), flush=True)


torch.manual_seed(0)
x = torch.randn(8 * BATCH, 16)
y = torch.randint(0, 4, (8 * BATCH,))
net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)

group = cohort.Group(args.job, args.coordinator, args.worker_id)
state = cohort.elastic.TorchState(group, model=net, optimizer=opt, steps=0)
trainer: dict = {}
formations = []


def on_reform() -> None:
    cohort.torch.managed.init_process_group(state)
    ddp = torch.nn.parallel.DistributedDataParallel(net)
    # DDP rebuilds its buckets after its first backward, in the order the gradients came: a
    # new layout, and at 3 ranks or more a sum in another order for some elements. A DDP made
    # at a re-formation would take its first real step on the first layout where the
    # fault-free run took it on the rebuilt one; one backward of nothing (its gradients
    # dropped, the optimizer not stepped) rebuilds them in every generation alike.
    (ddp(x[:1]) * 0).sum().backward()
    opt.zero_grad()
    trainer["ddp"] = ddp
    formations.append(state.generation)
    report(
        "generation",
        generation=state.generation,
        rank=state.rank,
        size=state.size,
        steps=state.steps,
        backend=torch.distributed.get_backend(),
    )


def on_failure(e: cohort.CollectiveError) -> None:
    report(
        "error",
        cls=type(e).__name__,
        generation=e.generation,
        cause_rank=e.rank,
        cause_worker=e.worker_id,
        cause=str(e.cause),
        message=str(e).splitlines()[0],
    )


state.register_reset_callbacks([on_reform])
state.register_failure_callbacks([on_failure])


@cohort.elastic.run
def train(state: cohort.elastic.TorchState) -> None:
    world, rank = state.size, state.rank
    if BATCH % world:
        raise SystemExit(f"a world of {world} does not divide the batch of {BATCH}")
    per = BATCH // world
    while state.steps < args.steps:
        at = (state.steps * BATCH) % len(x) + rank * per
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(trainer["ddp"](x[at : at + per]), y[at : at + per])
        if state.steps == args.hold_at and len(formations) == 1:
            report("holding", generation=state.generation, rank=rank, step=state.steps)
            sys.stdin.read()  # the test's cue: stdin closed (after a SIGCONT, or never: SIGKILL)
        loss.backward()  # DDP's allreduce on the managed gloo group
        opt.step()
        state.steps += 1
        state.commit(step=state.steps)
    h = hashlib.sha256()
    for p in net.parameters():
        h.update(p.detach().numpy().tobytes())
    report("done", steps=state.steps, size=world, formations=len(formations), sha256=h.hexdigest())


report("joined")
train(state)
if not formations:
    report("spare")
