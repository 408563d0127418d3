"""Signals on real worker processes: SIGTERM ends a worker that has no commit points (a spare
waiting for a generation, a plain collective loop, raw or through torch.distributed), Ctrl-C
interrupts torch.distributed's all_reduce as it does a raw collective, and a tensor re-pointed
while its collective runs raises instead of returning as if the result were in it.

Every signal is sent from this process to the worker with os.kill once the worker is where the
test means it to be; every wait is bounded."""

import json
import re
import signal
import time

from conftest import import_torch, torch2_only
from test_failures import thread_dump, wait_until_asleep

torch = import_torch()

# SIGTERM must end a worker well before a pod's grace period (30 s) or Slurm's KillWait; these
# bounds leave room for a loaded 2-core machine, and are far below the 30 s no-progress
# deadline that the workers use (a call that only ends at its deadline fails them).
EXIT_BOUND = 20.0


def events(worker, kind):
    lines = worker.output().splitlines()
    return [e for e in (json.loads(line) for line in lines if line.startswith("{")) if e["event"] == kind]


def wait_event(worker, kind, timeout):
    worker.wait_for_line(r'"event": "%s"' % kind, timeout)
    return events(worker, kind)[-1]


def exits_cleanly_on_sigterm(worker) -> None:
    """SIGTERM: the worker exits 0 within EXIT_BOUND and says why on stderr."""
    worker.signal(signal.SIGTERM)
    try:
        rc = worker.process.wait(timeout=EXIT_BOUND)
    except Exception:
        dump = thread_dump(worker.process.pid)
        raise AssertionError(f"still alive {EXIT_BOUND} s after SIGTERM:\n{worker.output()}\n{dump}") from None
    assert rc == 0, worker.output()
    assert re.search(r"^cohort: SIGTERM received", worker.output(), re.M), worker.output()


def test_sigterm_ends_a_spare_waiting_for_a_generation(coordinator_factory, spawn):
    coord = coordinator_factory(1, 1)
    member = spawn("w0", "signals.py", "idle", coord.endpoint, "spare", "w0", stdin=True)
    member.wait_for_line('"event": "joined"', timeout=60)
    spare = spawn("w1", "signals.py", "spare", coord.endpoint, "spare", "w1")
    spare.wait_for_line('"event": "waiting"', timeout=60)
    wait_until_asleep(spare.process.pid, steady=0.05, timeout=20)
    exits_cleanly_on_sigterm(spare)
    assert "left the job gracefully" in spare.output(), spare.output()
    member.process.stdin.close()
    member.process.kill()


def sigterm_ends_a_plain_loop(coordinator_factory, spawn, mode):
    coord = coordinator_factory(1, 2)
    workers = [spawn(f"w{r}", "signals.py", mode, coord.endpoint, mode, f"w{r}") for r in range(2)]
    for w in workers:
        w.wait_for_line(r'"step": 3\b', timeout=60)
    exits_cleanly_on_sigterm(workers[0])
    assert "left job %s gracefully" % mode in workers[0].output(), workers[0].output()
    # The peer's collective fails (the generation was revoked by the leave): it is not left
    # waiting for a rank that is gone. (Not on torch 1.13 through torch.distributed, whose
    # Work.wait() returns from a failed call: docs/python.md, "PyTorch".)
    if mode == "raw-loop" or int(torch.__version__.split(".")[0]) >= 2:
        err = wait_event(workers[1], "error", timeout=30)
        assert err["message"], err


def test_sigterm_ends_a_raw_allreduce_loop(coordinator_factory, spawn):
    sigterm_ends_a_plain_loop(coordinator_factory, spawn, "raw-loop")


def test_sigterm_ends_a_torch_distributed_loop(coordinator_factory, spawn):
    sigterm_ends_a_plain_loop(coordinator_factory, spawn, "dist-loop")


def key_values(out: str, kind: str) -> list[dict]:
    """The `event=KIND key=value ...` lines of `kind` in `out` (the protocol of
    `cohort-worker train` that elastic_train.py speaks)."""
    found = []
    for m in re.finditer(r"^event=%s (.*)$" % kind, out, re.M):
        found.append(dict(kv.split("=", 1) for kv in m.group(1).split()))
    return found


def test_sigterm_between_generations_leaves_an_elastic_loop_with_its_last_commit(coordinator_factory, spawn):
    """A rank of an elastic loop with commit points (elastic_train.py, which the chaos suite and
    the Kubernetes rehearsal run) that gets SIGTERM while it waits for the next generation (its
    peer died) leaves the job with the last commit's parameters, says so (`leave`, then its
    `summary`) and exits 0, as `cohort-worker train` does. A pod scaled down just after a
    re-formation began is in that wait."""
    coord = coordinator_factory(2, 2)
    args = ["--coordinator", coord.endpoint, "--job", "sigterm-between", "--steps", "1000000", "--size", "4K"]
    args += ["--step-interval-ms", "10", "--no-progress-ms", "2000"]
    a = spawn("a", "elastic_train.py", *args, "--worker-id", "a")
    b = spawn("b", "elastic_train.py", *args, "--worker-id", "b")
    for w in (a, b):
        w.wait_for_line(r"^event=step .* step=3\b", timeout=60)
    b.kill()
    a.wait_for_line(r"^event=error ", timeout=30)
    # Waiting at the rendezvous for a second member (min_workers = 2): asleep in the call.
    wait_until_asleep(a.process.pid, steady=0.2, timeout=20)
    exits_cleanly_on_sigterm(a)
    out = a.output()
    assert "SIGTERM while waiting for a generation" in out, out
    (leave,) = key_values(out, "leave")
    (summary,) = key_values(out, "summary")
    committed = max(int(e["step"]) for e in key_values(out, "step"))
    assert leave["joined"] == "false", leave
    assert int(leave["step"]) == committed >= 3, (leave, committed)
    assert leave["params_digest"] == leave["expected_digest"], leave
    assert summary["left"] == "true" and int(summary["final_step"]) == committed, summary
    assert summary["params_digest"] == leave["params_digest"], (summary, leave)


def test_ctrl_c_interrupts_torch_distributed_all_reduce(coordinator_factory, spawn):
    """dist.all_reduce waits on torch's Work: that wait must look for signals as the raw
    collectives do (every 50 ms), not wait for the collective's 30 s deadline. torch 1.13's
    dist.all_reduce waits in C++ on a Work that cannot be a Python one (its DDP needs the C++
    future), so there Ctrl-C waits for the collective's end (docs/python.md)."""
    torch2_only(torch, "Ctrl-C inside torch.distributed's wait")
    coord = coordinator_factory(2)
    blocked = spawn("w0", "signals.py", "dist-block", coord.endpoint, "dist-intr", "w0")
    idle = spawn("w1", "signals.py", "idle", coord.endpoint, "dist-intr", "w1", stdin=True)
    try:
        blocked.wait_for_line('"event": "blocking"', timeout=60)
        wait_until_asleep(blocked.process.pid, steady=0.05, timeout=20)
        sent = time.time()
        blocked.signal(signal.SIGINT)
        try:
            got = wait_event(blocked, "interrupted", timeout=20)
        except AssertionError as e:
            raise AssertionError(f"{e}\nthreads of w0 after the SIGINT:\n{thread_dump(blocked.process.pid)}") from None
        # Loosely bounded (a loaded machine): the interruption came from the call's look for
        # signals, not from the end of the collective at its 30 s deadline.
        assert got["at"] - sent < 5.0, got["at"] - sent
        assert blocked.wait(timeout=30) == 0, blocked.output()
    finally:
        idle.process.kill()


def test_ctrl_c_in_a_work_wait_aborts_the_queued_call(coordinator_factory, spawn):
    """Ctrl-C while waiting on an ``allreduce_async`` Work whose peer never comes: the
    KeyboardInterrupt comes from the wait's look for signals, and the queued call is aborted
    with it (the communicator is unusable, as after an interrupted blocking call), so that the
    ``group.close()`` that follows returns at once instead of waiting for the peer up to the
    late-rank bound (30 min), and the process exits."""
    coord = coordinator_factory(2)
    blocked = spawn("w0", "signals.py", "async-block", coord.endpoint, "async-intr", "w0")
    idle = spawn("w1", "signals.py", "idle", coord.endpoint, "async-intr", "w1", stdin=True)
    try:
        blocked.wait_for_line('"event": "blocking"', timeout=60)
        wait_until_asleep(blocked.process.pid, steady=0.05, timeout=20)
        sent = time.time()
        blocked.signal(signal.SIGINT)
        got = wait_event(blocked, "interrupted", timeout=20)
        assert got["at"] - sent < 5.0, got["at"] - sent
        closed = wait_event(blocked, "closed", timeout=20)
        assert closed["seconds"] < 5.0, closed
        assert blocked.wait(timeout=30) == 0, blocked.output()
    finally:
        idle.process.kill()


def test_a_tensor_re_pointed_during_its_collective_raises(coordinator_factory, spawn):
    """A tensor moved to other memory (``set_``) while its allreduce runs: the call used (and
    held) the old storage, so it raises, saying that the result is not in the tensor, instead
    of returning as if it were."""
    coord = coordinator_factory(2)
    moved = spawn("w0", "signals.py", "moved", coord.endpoint, "moved", "w0")
    late = spawn("w1", "signals.py", "idle", coord.endpoint, "moved", "w1", stdin=True)
    moved.wait_for_line('"event": "blocking"', timeout=60)
    wait_until_asleep(moved.process.pid, steady=0.05, timeout=20)
    moved.signal(signal.SIGUSR1)  # its handler runs inside the blocked call: set_ to other memory
    moved.wait_for_line('"event": "moved"', timeout=20)
    late.process.stdin.close()  # now the peer joins the allreduce and it completes
    assert moved.wait(timeout=60) == 0, moved.output()
    assert not events(moved, "returned"), moved.output()
    changed = events(moved, "changed")[0]
    assert "memory changed while a collective ran" in changed["message"], changed
    assert changed["first"] == 7.0, changed  # the tensor's new memory was not written
    assert late.wait(timeout=60) == 0, late.output()
