"""A worker that runs every torch.distributed call on the "cohort" backend against the answer
computed locally, on torch 1.13 or 2.x.

argv: COORDINATOR JOB WORKER_ID. Every rank's input is a deterministic function of (rank,
index), small integers so that every result is exact; each rank computes every rank's input
and so the expected result. Prints `ok NAME` per check, `unsupported NAME: MESSAGE` for calls
that must raise, and `done CHECKS` at the end; a wrong result raises (exit status 1).
"""

import sys
import warnings

import torch
import torch.distributed as dist

import cohort
import cohort.torch

coordinator, job, worker_id = sys.argv[1:4]
group = cohort.Group(job, coordinator, worker_id, no_progress_timeout=20.0)
comm = group.next_generation()
rank, size = comm.rank, comm.size
TORCH2 = cohort.torch.TORCH2
checks = 0


def data(r: int, n: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return ((torch.arange(n) * 7 + r * 5) % 11).to(dtype)


def check(name: str, got: torch.Tensor, want: torch.Tensor) -> None:
    global checks
    if got.dtype != want.dtype or got.shape != want.shape or not torch.equal(got, want):
        raise AssertionError(f"rank {rank}: {name}: got {got.flatten()[:8]} want {want.flatten()[:8]}")
    checks += 1
    print(f"ok {name}", flush=True)


def must_raise(name: str, fn, *words: str) -> None:
    """`fn` raises an error whose message names the call (every word in `words`)."""
    global checks
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the message is what is checked
        message = str(e)
        missing = [w for w in words if w not in message]
        if missing:
            raise AssertionError(f"rank {rank}: {name}: the error does not say {missing}: {message!r}") from e
        checks += 1
        print(f"unsupported {name}: {message.splitlines()[0]}", flush=True)
        return
    raise AssertionError(f"rank {rank}: {name} did not raise")


with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    pg = cohort.torch.init_process_group(comm)
registration = [str(w.message) for w in caught if "cohort" in str(w.message) or "Device capability" in str(w.message)]
assert not registration, f"registering the backend warned: {registration}"
assert dist.get_rank() == rank and dist.get_world_size() == size
assert dist.get_backend() == "cohort", dist.get_backend()
print(f"ok register torch={torch.__version__} python_backend={cohort.torch.PYTHON_BACKEND}", flush=True)

n = 12 * size
every = torch.stack([data(r, n) for r in range(size)])

t = data(rank, n)
dist.all_reduce(t)
check("all_reduce sum", t, every.sum(0))
t = data(rank, n)
dist.all_reduce(t, op=dist.ReduceOp.MAX)
check("all_reduce max", t, every.max(0).values)
t = data(rank, n)
dist.all_reduce(t, async_op=True).wait()
check("all_reduce async", t, every.sum(0))

t = data(rank, n)
dist.broadcast(t, src=size - 1)
check("broadcast", t, every[size - 1])

t = data(rank, n)
dist.reduce(t, dst=0)
if rank == 0:
    check("reduce", t, every.sum(0))

outs = [torch.empty(n) for _ in range(size)]
dist.all_gather(outs, data(rank, n))
check("all_gather", torch.stack(outs), every)

out = torch.empty(n // size)
dist.reduce_scatter(out, list(data(rank, n).chunk(size)))
check("reduce_scatter", out, every.sum(0).chunk(size)[rank])

dist.barrier()
checks += 1
print("ok barrier", flush=True)

if size == 1:
    pass  # no peer to send to
elif rank == 0:
    for peer in range(1, size):
        dist.send(data(0, 5), dst=peer)
    got = torch.empty(5)
    dist.recv(got, src=size - 1)
    check("send/recv", got, data(size - 1, 5))
else:
    got = torch.empty(5)
    dist.recv(got, src=0)
    check("send/recv", got, data(0, 5))
    if rank == size - 1:
        dist.send(data(rank, 5), dst=0)

if TORCH2:
    # What FSDP2, DTensor and DeviceMesh use.
    out = torch.empty(size * n)
    dist.all_gather_into_tensor(out, data(rank, n))
    check("all_gather_into_tensor", out, every.reshape(-1))
    out = torch.empty(size * n)
    dist.all_gather_into_tensor(out, data(rank, n), async_op=True).wait()
    check("all_gather_into_tensor async", out, every.reshape(-1))
    # The caller's wait() and the completer thread wait on the same cohort Work; thousands of
    # them in a row once deadlocked (a lock taken holding the GIL): a hang fails the test.
    for _ in range(3000):
        dist.all_gather_into_tensor(out, data(rank, n), async_op=True).wait()
    check("3000 async waits", out, every.reshape(-1))
    out = torch.empty(n // size)
    dist.reduce_scatter_tensor(out, data(rank, n))
    check("reduce_scatter_tensor", out, every.sum(0).chunk(size)[rank])
    if hasattr(dist.ReduceOp, "AVG"):
        out = torch.empty(n // size, dtype=torch.float64)
        dist.reduce_scatter_tensor(out, data(rank, n, torch.float64), op=dist.ReduceOp.AVG)
        check("reduce_scatter_tensor avg", out, (every.double().sum(0) / size).chunk(size)[rank])

    # Coalesced: several tensors, one work (FSDP2's and DTensor's batched collectives).
    outs = [torch.empty(size * n), torch.empty(size * 3)]
    with dist._coalescing_manager(async_ops=True) as cm:
        dist.all_gather_into_tensor(outs[0], data(rank, n))
        dist.all_gather_into_tensor(outs[1], data(rank + 1, 3))
    cm.wait()
    check("all_gather_into_tensor coalesced", outs[1], torch.stack([data(r + 1, 3) for r in range(size)]).reshape(-1))
    outs = [torch.empty(n // size), torch.empty(2)]
    with dist._coalescing_manager(async_ops=True) as cm:
        dist.reduce_scatter_tensor(outs[0], data(rank, n))
        dist.reduce_scatter_tensor(outs[1], data(rank, 2 * size))
    cm.wait()
    check(
        "reduce_scatter_tensor coalesced",
        outs[1],
        torch.stack([data(r, 2 * size) for r in range(size)]).sum(0).chunk(size)[rank],
    )

    import torch.distributed._functional_collectives as funcol

    got = funcol.all_reduce(data(rank, n), "sum", dist.group.WORLD)
    check("functional all_reduce", got.wait() if hasattr(got, "wait") else got, every.sum(0))

    ts = [data(rank, n), data(rank, 3)]
    dist.all_reduce_coalesced(ts)
    check("all_reduce_coalesced", ts[1], torch.stack([data(r, 3) for r in range(size)]).sum(0))

    out = torch.empty(n)
    dist.all_to_all_single(out, data(rank, n))
    want = torch.cat([data(r, n).chunk(size)[rank] for r in range(size)])
    check("all_to_all_single", out, want)
    outs = [torch.empty(4) for _ in range(size)]
    dist.all_to_all(outs, [data(rank * 10 + j, 4) for j in range(size)])
    check("all_to_all", torch.stack(outs), torch.stack([data(r * 10 + rank, 4) for r in range(size)]))

    gathered = [torch.empty(n) for _ in range(size)] if rank == 0 else None
    dist.gather(data(rank, n), gathered, dst=0)
    if rank == 0:
        check("gather", torch.stack(gathered), every)
    out = torch.empty(4)
    dist.scatter(out, [data(100 + r, 4) for r in range(size)] if rank == size - 1 else None, src=size - 1)
    check("scatter", out, data(100 + rank, 4))

    # A group name, and a one-dimensional DeviceMesh over the world.
    name = pg.group_name
    assert name, "the default group has no name"
    assert torch._C._distributed_c10d._resolve_process_group(name) is pg
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (size,))
    t = data(rank, n)
    dist.all_reduce(t, group=mesh.get_group())
    check(f"device mesh group={name}", t, every.sum(0))

    # torch's fault-tolerance hooks: the world binds to the generation cohort formed, whose
    # members' worker ids are the handles (cohort's coordinator is the quorum).
    # (torch 2.11 has no such hooks: nothing to bind.)
    if hasattr(dist, "_supports_reconfigure"):
        assert dist._supports_reconfigure()
        handles = [None] * size
        dist.all_gather_object(handles, dist._get_reconfigure_handle())
        # comm.members: every member in a generation answered whole, this rank's known ones in a sparse one.
        assert all(handles[m.rank] == m.worker_id for m in comm.members) and handles[rank] == worker_id, handles
        assert dist._reconfigure(11, handles).wait() and dist._reconfigure(12, set(handles)).wait()
        assert dist.group.WORLD._get_backend(torch.device("cpu")).reconfigured_uuid == 12
        t = data(rank, n)
        dist.all_reduce(t)
        check("all_reduce after reconfigure", t, every.sum(0))
        must_raise("reconfigure to a stranger", lambda: dist._reconfigure(13, [*handles, "stranger"]), "stranger")
        if size > 1:
            must_raise("reconfigure in another order", lambda: dist._reconfigure(14, handles[::-1]), "rank order")
    else:
        print("ok reconfigure: not in this torch", flush=True)

    # Calls cohort cannot run raise, naming the call.
    if size > 1:
        must_raise(
            "all_to_all_single uneven",
            lambda: dist.all_to_all_single(
                torch.empty(size + 1), torch.empty(size + 1), [1] * (size - 1) + [2], [1] * (size - 1) + [2]
            ),
            "all_to_all_single",
            "uneven",
        )
        # Subgroups: the even and the odd ranks (every rank makes both; the members of a group
        # build its backend, the others get no group). A subgroup's all_reduce and the world's
        # run at the same time, over the generation's links.
        evens, odds = list(range(0, size, 2)), list(range(1, size, 2))
        groups = {0: dist.new_group(evens), 1: dist.new_group(odds)}
        mine, members = groups[rank % 2], (evens, odds)[rank % 2]
        assert groups[1 - rank % 2] == dist.GroupMember.NON_GROUP_MEMBER
        assert dist.get_process_group_ranks(mine) == members
        t, w = data(rank, n), data(rank, n)
        works = [dist.all_reduce(t, group=mine, async_op=True), dist.all_reduce(w, async_op=True)]
        for work in works:
            work.wait()
        check(f"new_group {members}", t, every[members].sum(0))
        check("the world beside a subgroup", w, every.sum(0))
        g = data(rank, n)
        gathered = torch.empty(len(members) * n)
        dist.all_gather_into_tensor(gathered, g, group=mine)
        check(f"all_gather_into_tensor in {members}", gathered, every[members].reshape(-1))
        # Destroying the group closes its cohort communicator at once and frees its channel.
        import cohort.torch as cohort_torch

        backend = mine._get_backend(torch.device("cpu"))
        sub, channel = backend._comm(), backend._channel
        assert backend in [ref() for ref in cohort_torch._channels[channel]]
        dist.destroy_process_group(mine)
        assert backend not in [ref() for ref in cohort_torch._channels.get(channel, [])]
        must_raise("a destroyed group's communicator", lambda: sub.barrier(), "closed")

if size > 1:
    must_raise("send with a tag", lambda: dist.send(data(rank, 2), dst=(rank + 1) % size, tag=7), "send", "tag 7")
    must_raise("recv with a tag", lambda: dist.recv(torch.empty(2), src=(rank + 1) % size, tag=7), "recv", "tag 7")
must_raise("monitored_barrier", lambda: dist.monitored_barrier(), "monitored_barrier")

print(f"done {checks}", flush=True)
dist.destroy_process_group()
comm.close()
group.leave(finished=True)
