#!/usr/bin/env python3
"""HSDP on cohort with a replica group as the unit of failure (torch 2.x): kill a rank, and only
its replica group stops; the others train on.

The model, data and settings of digits.py (scikit-learn's digits, MLP 64-H-H-10, global batch
64, SGD lr 0.05 momentum 0.9, seed 1). R replica groups of S ranks: FSDP2's ``fully_shard``
shards every Linear and the root over the replica group's 1-D DeviceMesh, and
:class:`cohort.hsdp.Trainer` averages the gradient shards across the live groups
(docs/python.md, "HSDP with replica groups as the unit of failure"). Step s always trains on
the same 64 samples, split over the ranks of the groups that are live at that step.

The coordinator needs one job per replica group (S workers each) and the cross-replica job
(S to R*S workers), in its settings file:

    cat > hsdp.toml <<'EOF'
    [defaults]
    join_window_ms = 200
    [jobs."hsdp.replica-0"]
    min_workers = 2
    max_workers = 2
    [jobs."hsdp.replica-1"]
    min_workers = 2
    max_workers = 2
    [jobs."hsdp.cross"]
    min_workers = 2
    max_workers = 4
    join_window_ms = 10000
    EOF
    cohort-coordinator serve --listen 127.0.0.1:7470 --config hsdp.toml &
    for r in 0 1; do for w in a b; do
      python examples/pytorch/hsdp_ft.py --coordinator http://127.0.0.1:7470 --replica $r --worker-id r$r$w &
    done; done
    # kill -9 one of replica 1's processes: replica 0 goes on; start a replacement for it
    # (the same command, any worker id) and it rejoins with the current state:
    python examples/pytorch/hsdp_ft.py --coordinator http://127.0.0.1:7470 --replica 1 --worker-id r1c

Prints ``event=step`` per step, ``event=generation`` per formation (``job=replica`` or
``job=cross``, with the live groups), and at the end:
    event=finished gen=G rank=R step=S params_digest=H backend=cohort-hsdp replica=I torch_backend=B
    test_accuracy=A step_ms_median=T longest_gap_ms=G replica_formations=.. cross_formations=..
    skipped_steps=.. replica_failures=.. t_ms=..
where ``params_digest`` hashes the full (unsharded) parameters, gathered in the replica group,
and ``torch_backend`` names the replica group's world, FSDP2's backend: ``cohort``, or
``cohort_gloo`` with ``--managed`` (torch's gloo, managed by cohort: cohort.torch.managed).
"""

from __future__ import annotations

import argparse
import hashlib
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from digits import GLOBAL_BATCH, data, epoch_order, model  # noqa: E402 - the same model and data


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--coordinator", required=True)
    ap.add_argument("--job", default="hsdp")
    ap.add_argument("--replica", type=int, required=True, help="this worker's replica group")
    ap.add_argument("--worker-id", required=True)
    ap.add_argument("--steps", type=int, default=46, help="steps to train (23 per epoch)")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--save", metavar="PATH", help="save the full parameters here (torch.save, a list)")
    ap.add_argument(
        "--managed",
        action="store_true",
        help="FSDP2 on torch's gloo managed by cohort (cohort.torch.managed), not on the cohort backend",
    )
    args = ap.parse_args()
    torch.set_num_threads(1)

    from torch.distributed.fsdp import fully_shard

    import cohort.hsdp
    from cohort.events import emit

    (xtr, ytr), (xte, yte) = data(args.seed)
    per_epoch = len(xtr) // GLOBAL_BATCH

    def build(mesh):
        net = model(args.hidden, args.seed)
        for layer in net:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(net, mesh=mesh)
        return net, torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)

    def batch(step: int) -> torch.Tensor:
        order = epoch_order(args.seed, step // per_epoch, len(xtr))
        at = (step % per_epoch) * GLOBAL_BATCH
        return order[at : at + GLOBAL_BATCH]

    def train_step(net: torch.nn.Module, rows: torch.Tensor) -> None:
        torch.nn.functional.cross_entropy(net(xtr[rows]), ytr[rows]).backward()

    backend = "gloo" if args.managed else "cohort"
    trainer = cohort.hsdp.Trainer(args.job, args.coordinator, args.replica, args.worker_id, build, backend=backend)
    if not trainer.run(train_step, batch, args.steps):
        if trainer.outcome == "not-needed":
            emit("leave", gen=0, step=0, extra={"replica": args.replica, "reason": "spare-not-needed"})
        return  # finished-without-this-group: run() said so (stderr, event leave); exit 0

    net = trainer.model
    with torch.no_grad():
        acc = (net(xte).argmax(1) == yte).float().mean().item()
    full = [p.full_tensor().detach() for p in net.parameters()]  # a collective of the replica group
    h = hashlib.sha256()
    for t in full:
        h.update(t.numpy().tobytes())
    if args.save:
        torch.save(full, args.save)
    emit(
        "finished",
        gen=trainer.comm.generation,
        rank=trainer.comm.rank,
        step=trainer.step,
        params_digest=h.hexdigest()[:16],
        extra=dict(
            backend="cohort-hsdp",
            replica=args.replica,
            torch_backend=torch.distributed.get_backend(),
            test_accuracy=f"{acc:.4f}",
            **{k: v for k, v in trainer.summary().items() if k != "steps"},
        ),
    )
    trainer.leave()


if __name__ == "__main__":
    main()
