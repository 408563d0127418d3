"""A worker that runs torch.distributed point-to-point patterns on the "cohort" backend, on
torch 1.13 or 2.x, each checked against the locally computed answer.

argv: COORDINATOR JOB WORKER_ID [managed]. With ``managed`` the patterns run on torch's gloo
managed by cohort (:mod:`cohort.torch.managed`) instead of the cohort backend. Prints
`ok NAME` per check and `done CHECKS` at the end; a wrong result or an error exits with
status 1. The patterns post receives before the matching
sends (a ring, a pair), which deadlocked when a receive blocked the sends behind it.
"""

import sys

import torch
import torch.distributed as dist

import cohort
import cohort.torch

coordinator, job, worker_id = sys.argv[1:4]
managed = sys.argv[4:5] == ["managed"]
group = cohort.Group(job, coordinator, worker_id, no_progress_timeout=20.0)
if managed:
    import cohort.elastic
    import cohort.torch.managed

    state = cohort.elastic.ObjectState(group, step=0)
    state.reform()
    comm = state.comm
else:
    comm = group.next_generation()
rank, size = comm.rank, comm.size
checks = 0


def data(r: int, n: int, salt: int = 0) -> torch.Tensor:
    return ((torch.arange(n) * 7 + r * 5 + salt) % 11).to(torch.float32)


def check(name: str, got: torch.Tensor, want: torch.Tensor) -> None:
    global checks
    if not torch.equal(got, want):
        raise AssertionError(f"rank {rank}: {name}: got {got.flatten()[:8]} want {want.flatten()[:8]}")
    checks += 1
    print(f"ok {name}", flush=True)


if managed:
    cohort.torch.managed.init_process_group(state, timeout=60)
else:
    cohort.torch.init_process_group(comm)
print(f"ok register torch={torch.__version__} backend={dist.get_backend()}", flush=True)
right, left = (rank + 1) % size, (rank - 1) % size

# A ring, receive first: every rank posts irecv from the left, then isend to the right.
for n in (5, 1 << 20):  # one message, and several segments of 4 MiB
    got = torch.empty(n)
    recv = dist.irecv(got, left)
    send = dist.isend(data(rank, n), right)
    recv.wait()
    send.wait()
    check(f"ring irecv then isend {n}", got, data(left, n))

# A pair, both receiving first (0 with 1, 2 with 3, ...; a last odd rank sits out).
peer = rank ^ 1
if peer < size:
    for salt in range(3):  # in order, several times
        got = torch.empty(1000)
        recv = dist.irecv(got, peer)
        send = dist.isend(data(rank, 1000, salt), peer)
        send.wait()
        recv.wait()
        check(f"pair irecv then isend {salt}", got, data(peer, 1000, salt))

# A receive posted before a collective, its send after it.
got = torch.empty(64)
recv = dist.irecv(got, left)
total = torch.ones(4)
dist.all_reduce(total)
check("all_reduce between irecv and isend", total, torch.full((4,), float(size)))
dist.isend(data(rank, 64, 9), right).wait()
recv.wait()
check("irecv across a collective", got, data(left, 64, 9))

# Blocking send and recv, the even ranks sending first (the pattern that always worked).
if size > 1:
    got = torch.empty(16)
    if rank % 2 == 0:
        dist.send(data(rank, 16, 3), right)
        dist.recv(got, left)
    else:
        dist.recv(got, left)
        dist.send(data(rank, 16, 3), right)
    check("blocking send and recv", got, data(left, 16, 3))

# batch_isend_irecv around the ring, the receive listed first (torch's pipeline pattern).
got = torch.empty(300)
ops = [dist.P2POp(dist.irecv, got, left), dist.P2POp(dist.isend, data(rank, 300, 4), right)]
for work in dist.batch_isend_irecv(ops):
    work.wait()
check("batch_isend_irecv", got, data(left, 300, 4))

dist.barrier()
print(f"done {checks}", flush=True)
group.leave(finished=True)
