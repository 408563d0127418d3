"""A worker that runs every collective, dtype and reduce op against NumPy's answer.

argv: COORDINATOR JOB WORKER_ID. Inputs are deterministic functions of (rank, index), small
integers so that every dtype's result is exact; each rank computes every rank's input and so
the expected result. Prints `ok CHECKS` at the end; any mismatch raises (exit status 1).
"""

import sys

import numpy as np

import cohort

coordinator, job, worker_id = sys.argv[1:4]
group = cohort.Group(job, coordinator, worker_id, no_progress_timeout=20.0)
comm = group.next_generation()
rank, size = comm.rank, comm.size
checks = 0

DTYPES = ["float32", "float64", "float16", "int32", "int64", "uint8"]
OPS = ["sum", "prod", "min", "max", "avg"]
COUNTS = [0, 1, 7, 1000, 65537]  # 65537 elements: several 1 MiB segments for f64, not divisible by any world


def inputs(r: int, n: int, dtype: str, op: str) -> np.ndarray:
    i = np.arange(n)
    if op == "prod":
        return ((i + r) % 3 + 1).astype(dtype)  # 1..3: products over <= 5 ranks stay exact
    return ((i * 7 + r * 5) % 11).astype(dtype)


def expected(n: int, dtype: str, op: str) -> np.ndarray:
    stack = np.stack([inputs(r, n, dtype, op).astype(np.float64) for r in range(size)]) if n else np.zeros((size, 0))
    if op in ("sum", "avg"):
        total = stack.sum(0)
        if op == "sum":
            return total.astype(dtype)
        if np.dtype(dtype).kind in "iu":
            return (total // size).astype(dtype)
        wide = np.float64 if dtype == "float64" else np.float32
        return (total.astype(wide) / wide(size)).astype(dtype)
    return {"prod": stack.prod(0), "min": stack.min(0), "max": stack.max(0)}[op].astype(dtype)


def check(name: str, got: np.ndarray, want: np.ndarray) -> None:
    global checks
    if got.dtype != want.dtype or got.shape != want.shape or not np.array_equal(got, want):
        bad = np.flatnonzero(got != want)[:5] if got.shape == want.shape else "shape"
        raise AssertionError(f"rank {rank}: {name}: wrong result at {bad}: got {got[:8]} want {want[:8]}")
    checks += 1


for dtype in DTYPES:
    for op in OPS:
        for n in COUNTS:
            buf = inputs(rank, n, dtype, op)
            address = buf.ctypes.data
            comm.allreduce(buf, op)
            assert buf.ctypes.data == address
            check(f"allreduce {dtype} {op} n={n}", buf, expected(n, dtype, op))
    for op in ("sum", "max"):
        block = 1001
        full = np.stack([inputs(r, block * size, dtype, op) for r in range(size)])
        out = np.empty(block, dtype=dtype)
        comm.reduce_scatter(inputs(rank, block * size, dtype, op), out, op)
        whole = expected(block * size, dtype, op)
        check(f"reduce_scatter {dtype} {op}", out, whole[rank * block : (rank + 1) * block])
        buf = inputs(rank, block, dtype, op)
        comm.reduce(buf, root=size - 1, op=op)
        if rank == size - 1:
            check(f"reduce {dtype} {op}", buf, expected(block, dtype, op))
    mine = inputs(rank, 333, dtype, "sum")
    out = np.empty(333 * size, dtype=dtype)
    comm.allgather(mine, out)
    check(f"allgather {dtype}", out, np.concatenate([inputs(r, 333, dtype, "sum") for r in range(size)]))
    # In place: the input is this rank's own block of the output.
    out2 = np.zeros(333 * size, dtype=dtype)
    out2[rank * 333 : (rank + 1) * 333] = mine
    comm.allgather(out2[rank * 333 : (rank + 1) * 333], out2)
    check(f"allgather in place {dtype}", out2, out)
    root = 1 % size
    buf = inputs(rank, 4099, dtype, "sum") if rank == root else np.zeros(4099, dtype=dtype)
    comm.broadcast(buf, root=root)
    check(f"broadcast {dtype}", buf, inputs(root, 4099, dtype, "sum"))
    g = np.empty(50 * size, dtype=dtype) if rank == 0 else None
    comm.gather(inputs(rank, 50, dtype, "sum"), g, root=0)
    if rank == 0:
        check(f"gather {dtype}", g, np.concatenate([inputs(r, 50, dtype, "sum") for r in range(size)]))
    s_in = inputs(0, 60 * size, dtype, "sum") if rank == 0 else None
    s_out = np.empty(60, dtype=dtype)
    comm.scatter(s_in, s_out, root=0)
    check(f"scatter {dtype}", s_out, inputs(0, 60 * size, dtype, "sum")[rank * 60 : (rank + 1) * 60])
    a_in = np.concatenate([np.full(5, rank * 10 + j, dtype=dtype) for j in range(size)])
    a_out = np.empty_like(a_in)
    comm.alltoall(a_in, a_out)
    check(f"alltoall {dtype}", a_out, np.concatenate([np.full(5, j * 10 + rank, dtype=dtype) for j in range(size)]))

# Point to point around the ring, and a barrier.
if size > 1:
    right, left = (rank + 1) % size, (rank - 1) % size
    msg = np.arange(100, dtype=np.int64) + rank
    got = np.empty(100, dtype=np.int64)
    if rank % 2 == 0:
        comm.send(msg, right)
        comm.recv(got, left)
    else:
        comm.recv(got, left)
        comm.send(msg, right)
    check("send/recv", got, np.arange(100, dtype=np.int64) + left)
comm.barrier()

# Other exporters of the buffer protocol, and queued calls in issue order.
ba = bytearray([rank + 1] * 16)
comm.allreduce(ba, "sum")
check("bytearray", np.frombuffer(ba, dtype=np.uint8), np.full(16, sum(range(1, size + 1)) % 256, dtype=np.uint8))
big = np.zeros(100, dtype=np.float32)
view = big[10:20]
view[:] = rank + 1
comm.allreduce(view)  # a contiguous view: the parent's memory is reduced
check("view", big[10:20], np.full(10, sum(range(1, size + 1)), dtype=np.float32))
works = []
bufs = [np.full(1000 * (k + 1), k + rank, dtype=np.float64) for k in range(4)]
for b in bufs:
    works.append(comm.allreduce_async(b))
sync_buf = np.full(10, 1.0, dtype=np.float64)
comm.allreduce(sync_buf)  # waits for the queued ones first (one order on every rank)
for k, (w, b) in enumerate(zip(works, bufs)):
    assert w.wait(timeout=30.0) and w.is_completed()
    check(f"allreduce_async {k}", b, np.full(1000 * (k + 1), sum(k + r for r in range(size)), dtype=np.float64))
check("allreduce after queued", sync_buf, np.full(10, float(size)))

# torch tensors, bfloat16 included (read through data_ptr), when torch is present.
try:
    import torch
except ImportError:
    torch = None
if torch is not None:
    for tdtype in [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.uint8]:
        t = torch.full((513,), rank + 1, dtype=tdtype)
        ptr = t.data_ptr()
        comm.allreduce(t, "sum")
        assert t.data_ptr() == ptr
        want = torch.full((513,), sum(range(1, size + 1)), dtype=tdtype)
        if not torch.equal(t, want):
            raise AssertionError(f"rank {rank}: torch {tdtype}: {t[:4]} != {want[:4]}")
        checks += 1
    out = torch.empty(7 * size, dtype=torch.bfloat16)
    comm.allgather(torch.full((7,), rank, dtype=torch.bfloat16), out)
    if not torch.equal(out, torch.arange(size, dtype=torch.bfloat16).repeat_interleave(7)):
        raise AssertionError(f"rank {rank}: bfloat16 allgather {out}")
    checks += 1

# Subgroups: the even and the odd ranks, each a communicator over the generation's links on a
# channel of its own, their queued calls in flight beside the world's.
evens, odds = list(range(0, size, 2)), list(range(1, size, 2))
members = evens if rank % 2 == 0 else odds
sub = comm.subgroup(members, 1 + rank % 2)
assert (sub.rank, sub.size, sub.generation) == (members.index(rank), len(members), comm.generation)
# Each of the subgroup's known members is the generation's member of that rank (both views are
# partial in a generation answered sparse: python/tests/conftest.py's sparse pass).
known = {m.rank: m.worker_id for m in comm.members}
expected = [(i, known[r]) for i, r in enumerate(members) if r in known]
assert [(m.rank, m.worker_id) for m in sub.members] == expected, (sub.members, comm.members)
assert any(m.rank == sub.rank and m.worker_id == group.worker_id for m in sub.members)
mine, world = np.full(4099, rank + 1.0), np.full(4099, rank + 1.0)
works = [sub.allreduce_async(mine), comm.allreduce_async(world)]
for w in works:
    assert w.wait(timeout=30.0)
check("subgroup allreduce", mine, np.full(4099, float(sum(r + 1 for r in members))))
check("the world beside a subgroup", world, np.full(4099, float(sum(r + 1 for r in range(size)))))
gathered = np.zeros(3 * len(members), dtype=np.int64)
sub.allgather(np.full(3, rank, dtype=np.int64), gathered)
check("subgroup allgather", gathered, np.repeat(np.array(members, dtype=np.int64), 3))
for bad, says in [([rank, rank], "twice"), ([size], "not a rank of the generation")]:
    try:
        comm.subgroup(bad, 3)
    except cohort.InvalidArgumentError as e:
        assert says in str(e), e
        checks += 1
    else:
        raise AssertionError(f"rank {rank}: subgroup {bad} was accepted")
if size > 1:
    try:
        comm.subgroup([r for r in range(size) if r != rank], 3)
    except cohort.InvalidArgumentError as e:
        assert "leaves out this process" in str(e), e
        checks += 1
    else:
        raise AssertionError(f"rank {rank}: a subgroup without this rank was accepted")

print(f"ok {checks}", flush=True)
comm.close()
# Closing a communicator closes its subgroups.
try:
    sub.barrier()
except cohort.InvalidArgumentError as e:
    assert "closed" in str(e), e
else:
    raise AssertionError(f"rank {rank}: a subgroup of a closed communicator ran a barrier")
group.leave(finished=True)
