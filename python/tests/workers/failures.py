"""Worker for the failure tests. argv: MODE COORDINATOR JOB WORKER_ID [options].

Modes:
  loop       allreduce 8 MiB forever, printing `step N`; on failure print the exception's class
             and root cause, re-form, verify one allreduce in the new generation, print `reformed`.
  subloop    as loop, over subgroups: each step the even and the odd ranks' subgroups (one
             channel each) allreduce 8 MiB while the world allreduces 4 KiB, both queued; on
             failure the same reports, then the next generation's subgroups verify one step.
  badargs    one rank: every kind of bad argument raises InvalidArgumentError and changes
             nothing (a valid call still works after each).
  gil        a Python thread keeps counting while long allreduces run.
  interrupt  rank 0 blocks in an allreduce its peer never joins; prints when Ctrl-C lands.
  idle       joins, prints `joined`, then waits on stdin (the peer that never calls).
  rollback   both ranks commit step 1 of an ObjectState; then rank 1 closes its communicator
             and rank 0 commits step 2, whose agreement fails: its checkpoint is back at step 1.
  sigterm    prints `joined`, then polls group.leaving until SIGTERM sets it.
"""

import json
import signal
import sys
import threading
import time

import numpy as np

import cohort

mode, coordinator, job, worker_id = sys.argv[1:5]
no_progress = float(sys.argv[5]) if len(sys.argv) > 5 else 10.0


def report(kind: str, **facts) -> None:
    print(json.dumps({"event": kind, "worker": worker_id, **facts}), flush=True)


def report_error(e: cohort.CollectiveError) -> None:
    """The failure as the tests read it: its class and its root cause."""
    report(
        "error",
        cls=type(e).__name__,
        generation=e.generation,
        peer=e.peer,
        cause_rank=e.rank,
        cause_worker=e.worker_id,
        cause_host=e.host,
        reason=e.reason,
        is_timeout=isinstance(e, TimeoutError),
        message=str(e),
        after=getattr(e, "after", None),
    )


# late_rank_timeout at the ceiling: a peer that stays out of a collective (rollback's closed
# communicator) fails it at the ceiling, as these tests expect, not after the default 30 min.
group = cohort.Group(job, coordinator, worker_id, no_progress_timeout=no_progress, late_rank_timeout=no_progress)
comm = group.next_generation()
report("joined", rank=comm.rank, size=comm.size, generation=comm.generation)

if mode == "loop":
    data = np.empty(2 << 20, dtype=np.float32)
    step = 0
    while True:
        data.fill(comm.rank + 1)
        try:
            comm.allreduce(data)
        except cohort.CollectiveError as e:
            report_error(e)
            break
        assert data[0] == sum(range(1, comm.size + 1)), data[:4]
        step += 1
        report("step", step=step)
    comm.close()
    comm = group.next_generation()
    x = np.full(1000, comm.rank + 1, dtype=np.float64)
    comm.allreduce(x)
    assert (x == sum(range(1, comm.size + 1))).all()
    report("reformed", size=comm.size, generation=comm.generation, members=[m.worker_id for m in comm.members])
    group.leave(finished=True)

elif mode == "subloop":

    def parity_subgroup(c):
        members = [r for r in range(c.size) if r % 2 == c.rank % 2]
        return c.subgroup(members, 1 + c.rank % 2), members

    sub, members = parity_subgroup(comm)
    big, small = np.empty(2 << 20, dtype=np.float32), np.empty(1024, dtype=np.float32)
    step = 0
    while True:
        big.fill(comm.rank + 1)
        small.fill(comm.rank + 1)
        works = [sub.allreduce_async(big), comm.allreduce_async(small)]
        try:
            for w in works:
                w.wait(timeout=60.0)
        except cohort.CollectiveError as e:
            report_error(e)
            break
        assert big[0] == sum(r + 1 for r in members) and small[0] == sum(range(1, comm.size + 1)), (big[:2], small[:2])
        step += 1
        report("step", step=step)
    comm.close()
    comm = group.next_generation()
    sub, members = parity_subgroup(comm)
    big.fill(comm.rank + 1)
    sub.allreduce(big)
    assert big[0] == sum(r + 1 for r in members), big[:2]
    report("reformed", size=comm.size, generation=comm.generation, members=[m.worker_id for m in comm.members])
    comm.close()
    group.leave(finished=True)

elif mode == "badargs":
    ok = np.ones(8, dtype=np.float32)

    def still_works() -> None:
        x = np.ones(8, dtype=np.float32)
        comm.allreduce(x)
        assert (x == comm.size).all()

    cases = {
        "non-contiguous": lambda: comm.allreduce(np.ones(16, dtype=np.float32)[::2]),
        "complex dtype": lambda: comm.allreduce(np.ones(4, dtype=np.complex64)),
        "int8 dtype": lambda: comm.allreduce(np.ones(4, dtype=np.int8)),
        "read-only": lambda: comm.allreduce(np.frombuffer(b"\0" * 16, dtype=np.float32)),
        "not a buffer": lambda: comm.allreduce([1.0, 2.0]),
        "unknown op": lambda: comm.allreduce(ok, "median"),
        "allgather sizes": lambda: comm.allgather(np.ones(4, np.float32), np.ones(5, np.float32)),
        "allgather dtypes": lambda: comm.allgather(np.ones(4, np.float32), np.ones(4 * comm.size, np.float64)),
        "reduce_scatter sizes": lambda: comm.reduce_scatter(np.ones(3, np.float32), np.ones(2, np.float32)),
        "broadcast root": lambda: comm.broadcast(ok, root=comm.size),
        "send to self": lambda: comm.send(ok, comm.rank),
        "recv from nowhere": lambda: comm.recv(ok, 99),
        "unaligned": lambda: comm.allreduce(np.frombuffer(bytearray(20), dtype=np.float32, offset=1, count=4)),
        "gather without output": lambda: comm.gather(ok, None, root=comm.rank),
    }
    try:
        import torch

        cases["non-contiguous tensor"] = lambda: comm.allreduce(torch.ones(4, 4).t())
        cases["complex tensor"] = lambda: comm.allreduce(torch.ones(4, dtype=torch.complex64))
    except ImportError:
        pass
    raised = []
    for name, call in cases.items():
        try:
            call()
        except cohort.InvalidArgumentError as e:
            assert isinstance(e, ValueError) and str(e), name
            raised.append(name)
        else:
            raise AssertionError(f"{name}: no error")
        still_works()
    bad_kwargs = [dict(no_progress_timeout=-1), dict(listen="nonsense"), dict(algorithm="quantum")]
    for kwargs in bad_kwargs:
        try:
            cohort.Group(job, coordinator, worker_id + "-x", **kwargs)
        except cohort.InvalidArgumentError:
            raised.append(str(kwargs))
        else:
            raise AssertionError(f"Group({kwargs}) accepted")
    comm.close()
    try:
        comm.allreduce(ok)
    except cohort.InvalidArgumentError as e:
        assert "closed" in str(e)
        raised.append("closed communicator")
    report("badargs", raised=raised)
    group.leave(finished=True)
    try:
        group.next_generation()
    except cohort.InvalidArgumentError as e:
        assert "closed" in str(e)
        raised.append("closed group")
    report("badargs-done", count=len(raised))

elif mode == "gil":
    counter = [0]
    stop = threading.Event()

    def count() -> None:
        while not stop.is_set():
            counter[0] += 1

    t = threading.Thread(target=count)
    t.start()
    data = np.ones(16 << 20, dtype=np.float32)  # 64 MiB
    during = []
    for _ in range(3):
        before = counter[0]
        started = time.perf_counter()
        comm.allreduce(data)
        during.append((counter[0] - before, time.perf_counter() - started))
    stop.set()
    t.join(timeout=10)
    report("gil", during=during)
    group.leave(finished=True)

elif mode == "interrupt":
    # Ctrl-C's KeyboardInterrupt as an interactive Python has it. A process started with
    # SIGINT ignored (any command run in the background by a non-interactive shell, and its
    # children: a CI runner's, say) inherits the ignoring, and Python then installs no
    # handler: the signal would be dropped by the kernel before cohort could see it.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    data = np.ones(1000, dtype=np.float32)
    try:
        # Inside the try: a SIGINT that lands before the call (a loaded machine can hold this
        # process between the line and the call) is still this test's KeyboardInterrupt, and
        # the test waits until the main thread sleeps in the call before it sends one.
        report("blocking")
        comm.allreduce(data)
        report("returned")
    except KeyboardInterrupt:
        report("interrupted", at=time.time())
    group.close()

elif mode == "diverge":
    # Both ranks claim commit 5 with different state: the sync must refuse, on every rank.
    checkpoint = cohort.Checkpoint()
    checkpoint.commit(f"state of {worker_id}".encode(), 5)
    # The commit point's agreement (what State.commit runs) sees it first, on every rank.
    try:
        checkpoint.agree(comm, bytes([0, 0]))
    except cohort.DivergedError as e:
        # Not agreed, so not kept: the checkpoint holds the last agreed commit (none).
        report("commit_diverged", message=str(e), step=checkpoint.step)
    # The sync's own check, for commits that never met an agreement (a joiner's, say).
    checkpoint.commit(f"state of {worker_id}".encode(), 5)
    try:
        checkpoint.sync(comm, b"current")
    except cohort.DivergedError as e:
        report("diverged", message=str(e), step=checkpoint.step)
    # Equal states at the same commit sync fine.
    same = cohort.Checkpoint()
    same.commit(b"agreed", 6)
    snapshot, outcome = same.sync(comm, b"current")
    report("synced", snapshot=snapshot.decode(), step=outcome.step)
    group.leave(finished=True)

elif mode == "rollback":
    import cohort.elastic

    state = cohort.elastic.ObjectState(group, value="one")
    state.comm = comm
    state.commit(1)
    if comm.rank == 1:
        comm.close()  # this rank is gone for its peer: rank 0's next agreement fails
        report("closed")
        sys.stdin.readline()
    else:
        state.value = "two (a step whose collective may have failed)"
        try:
            state.commit(2)
        except cohort.CollectiveError as e:
            report_error(e)
        state.restore()
        report("restored", step=state.checkpoint.step, value=state.value)
    group.close()

elif mode == "idle":
    sys.stdin.readline()
    group.close()

elif mode == "sigterm":
    report("waiting")
    deadline = time.monotonic() + 20
    while not group.leaving and time.monotonic() < deadline:
        time.sleep(0.01)  # polling a flag, bounded
    report("leaving", leaving=group.leaving)
    group.leave()
