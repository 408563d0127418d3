"""Failure paths from Python, over real processes: a SIGKILLed or SIGSTOPped peer, bad
arguments, the GIL, Ctrl-C and SIGTERM."""

import json
import os
import shutil
import signal
import subprocess
import time

import pytest


def events(worker, kind):
    lines = worker.output().splitlines()
    return [e for e in (json.loads(line) for line in lines if line.startswith("{")) if e["event"] == kind]


def wait_event(worker, kind, timeout):
    worker.wait_for_line(r'"event": "%s"' % kind, timeout)
    return events(worker, kind)[-1]


def start_loop(coordinator_factory, spawn, world, *extra_coord, no_progress="10"):
    coord = coordinator_factory(world - 1, world, *extra_coord)
    workers = [
        spawn(f"w{r}", "failures.py", "loop", coord.endpoint, "loop", f"w{r}", no_progress) for r in range(world)
    ]
    for w in workers:
        w.wait_for_line(r'"step": 3\b', timeout=60)
    return workers


def kill_w1_and_check_the_survivors(workers):
    """SIGKILLs w1; every survivor's error names it (class, worker, rank, generation 1) and the
    survivors re-form without it."""
    victim = workers[1]
    victim.kill()
    survivors = [w for w in workers if w is not victim]
    names = sorted(f"w{i}" for i in range(len(workers)) if i != 1)
    for w in survivors:
        err = wait_event(w, "error", timeout=30)
        assert err["cls"] in ("PeerFailedError", "RevokedError"), err
        # The root cause names the killed worker exactly, on every survivor.
        assert err["cause_worker"] == "w1", err
        assert err["cause_rank"] == events(victim, "joined")[0]["rank"], err
        assert err["generation"] == 1, err
        done = wait_event(w, "reformed", timeout=60)
        assert done["size"] == len(survivors) and sorted(done["members"]) == names, done
        assert w.wait(timeout=30) == 0, w.output()


def test_sigkill_mid_allreduce_every_survivor_names_the_victim_and_reforms(coordinator_factory, spawn):
    kill_w1_and_check_the_survivors(start_loop(coordinator_factory, spawn, 3))


def test_sigkill_mid_subgroup_collectives_names_the_victim_on_every_survivor(coordinator_factory, spawn):
    """Subgroups share their generation's failure: a rank killed while its parity subgroup's
    allreduce and the world's are in flight fails every survivor's calls, in both subgroups,
    with the killed worker as the root cause; the next generation's subgroups work."""
    coord = coordinator_factory(3, 4)
    workers = [spawn(f"w{r}", "failures.py", "subloop", coord.endpoint, "subloop", f"w{r}") for r in range(4)]
    for w in workers:
        w.wait_for_line(r'"step": 3\b', timeout=60)
    kill_w1_and_check_the_survivors(workers)


def test_sigstopped_peer_fails_the_others_within_the_deadline(coordinator_factory, spawn):
    # The default 10 s ceiling: the ~0.5 s detection must come from the learned deadline and
    # the liveness check, not from the ceiling or the 3 s lease.
    workers = start_loop(coordinator_factory, spawn, 2, "--lease-ttl", "3s", no_progress="10")
    # Learned deadlines need a few samples per link (8): let them learn first.
    for w in workers:
        w.wait_for_line(r'"step": 20\b', timeout=60)
    stopped = time.monotonic()
    workers[1].signal(signal.SIGSTOP)
    try:
        err = wait_event(workers[0], "error", timeout=30)
        detected = time.monotonic() - stopped
        # The data plane found it and says that the peer's process is stopped, in the root
        # cause every rank sees. The survivor's own verdict can reach it as a TimeoutError, or,
        # when its report's revocation overtakes the failing call, as a RevokedError carrying
        # the same root cause (a lease expiry, 3 s, would carry another reason and a later
        # `after`).
        assert err["cls"] in ("TimeoutError", "RevokedError"), err
        # w1 is whichever rank it joined as: the rank waited on is the stopped one.
        assert err["cause_worker"] == "w1" and err["peer"] == err["cause_rank"], err
        assert err["reason"].startswith("process stopped, no progress for "), err
        # `after` is the stall the code measured itself, from the link's last progress to
        # its verdict: the learned deadline (its 250 ms floor here) plus the 200 ms look at
        # the stopped process, ~0.5 s. It leaves out the harness's own delays (signalling,
        # polling this worker's output), so it can be bound tightly even on a loaded 2-core
        # machine: 1.5 s is three times the nominal, and a regression to the ceiling (10 s)
        # or to the lease (3 s) is far beyond it.
        assert err["after"] < 1.5, err
        # Wall time, loosely (it includes the harness's polling of the output): well below
        # the 10 s ceiling.
        assert detected < 5.0, detected
    finally:
        workers[1].signal(signal.SIGCONT)


def test_bad_arguments_raise_and_change_nothing(coordinator_factory, spawn):
    coord = coordinator_factory(1)
    w = spawn("w0", "failures.py", "badargs", coord.endpoint, "bad", "w0")
    assert w.wait(timeout=60) == 0, w.output()
    names = events(w, "badargs")[0]["raised"]
    assert len(names) >= 17 and "closed communicator" in names, names
    assert events(w, "badargs-done")[0]["count"] == len(names) + 1


def test_the_gil_is_released_during_collectives(coordinator_factory, spawn):
    coord = coordinator_factory(2)
    workers = [spawn(f"w{r}", "failures.py", "gil", coord.endpoint, "gil", f"w{r}") for r in range(2)]
    for w in workers:
        assert w.wait(timeout=120) == 0, w.output()
        during = events(w, "gil")[0]["during"]
        # While each 64 MiB allreduce ran, the other Python thread kept counting.
        assert all(increments > 1000 for increments, _seconds in during), during


def wait_until_asleep(pid: int, steady: float, timeout: float) -> None:
    """Returns once the main thread of `pid` has been in interruptible sleep (state S) at every
    look for `steady` seconds; fails after `timeout`."""
    deadline = time.monotonic() + timeout
    asleep_since = None
    while time.monotonic() < deadline:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
        now = time.monotonic()
        if state != "S":
            asleep_since = None
        elif asleep_since is None:
            asleep_since = now
        elif now - asleep_since >= steady:
            return
        time.sleep(0.002)
    raise AssertionError(f"process {pid} never settled asleep in its call within {timeout} s")


def thread_dump(pid: int) -> str:
    """What every thread of `pid` is doing: its state and kernel wait channel, and (where gdb is
    installed) its native stack. For the message of a test that waited on the process in vain."""
    lines = []
    for tid in sorted(os.listdir(f"/proc/{pid}/task"), key=int):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                name, rest = f.read().split("(", 1)[1].rsplit(")", 1)
            with open(f"/proc/{pid}/task/{tid}/wchan") as f:
                wchan = f.read()
        except OSError as e:
            lines.append(f"thread {tid}: {e}")
            continue
        lines.append(f"thread {tid} ({name}): state {rest.split()[0]}, waiting in {wchan or '-'}")
    gdb = shutil.which("gdb")
    if gdb:
        run = subprocess.run(
            [gdb, "-batch", "-p", str(pid), "-ex", "thread apply all bt"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        lines.append(run.stdout[-20000:])
    return "\n".join(lines)


def test_ctrl_c_interrupts_a_blocked_collective(coordinator_factory, spawn):
    coord = coordinator_factory(2)
    blocked = spawn("w0", "failures.py", "interrupt", coord.endpoint, "intr", "w0")
    idle = spawn("w1", "failures.py", "idle", coord.endpoint, "intr", "w1", stdin=True)
    try:
        blocked.wait_for_line('"event": "blocking"', timeout=60)
        # The allreduce is entered right after the line; its main thread then parks in the
        # call (state S) for the whole no-progress window. Send the signal once it has been
        # seen asleep for 50 ms in a row: then the KeyboardInterrupt must come from the wait.
        wait_until_asleep(blocked.process.pid, steady=0.05, timeout=20)
        sent = time.time()
        blocked.signal(signal.SIGINT)
        try:
            got = wait_event(blocked, "interrupted", timeout=10)
        except AssertionError as e:
            # Say where the process was (this is how an inherited, ignored SIGINT was found).
            raise AssertionError(f"{e}\nthreads of w0 after the SIGINT:\n{thread_dump(blocked.process.pid)}") from None
        latency = got["at"] - sent
        print(f"KeyboardInterrupt {latency * 1e3:.1f} ms after SIGINT")
        assert latency < 1.0, latency
        assert blocked.wait(timeout=30) == 0, blocked.output()
    finally:
        idle.process.stdin.close()
        idle.process.wait(timeout=30)


def test_sigterm_sets_leaving(coordinator_factory, spawn):
    coord = coordinator_factory(1)
    w = spawn("w0", "failures.py", "sigterm", coord.endpoint, "term", "w0")
    w.wait_for_line('"event": "waiting"', timeout=60)
    w.signal(signal.SIGTERM)
    assert wait_event(w, "leaving", timeout=20)["leaving"] is True
    assert w.wait(timeout=30) == 0, w.output()


def test_members_claiming_one_commit_with_different_state_raise_diverged(coordinator_factory, spawn):
    coord = coordinator_factory(2)
    workers = [spawn(f"w{r}", "failures.py", "diverge", coord.endpoint, "div", f"w{r}") for r in range(2)]
    for w in workers:
        assert w.wait(timeout=60) == 0, w.output()
        c = events(w, "commit_diverged")[0]
        assert "commit of step 5" in c["message"] and "different state" in c["message"], c
        assert c["step"] is None, c  # rolled back: nothing was agreed before it
        d = events(w, "diverged")[0]
        assert "committed step 5" in d["message"] and d["step"] == 5, d  # nothing overwritten
        assert events(w, "synced")[0] == {"event": "synced", "worker": d["worker"], "snapshot": "agreed", "step": 6}


def test_a_commit_whose_agreement_fails_is_rolled_back(coordinator_factory, spawn):
    """State.commit is two-phase: the local snapshot becomes the commit only once every member
    agreed. A failed agreement rolls the checkpoint back, so restore() loads the last agreed
    step, not a step whose collective may have failed halfway."""
    coord = coordinator_factory(2)
    workers = [spawn(f"w{r}", "failures.py", "rollback", coord.endpoint, "rb", f"w{r}", stdin=True) for r in range(2)]
    joined = [json.loads(w.wait_for_line(r'^\{"event": "joined".*$', timeout=60).group(0)) for w in workers]
    (first,) = [w for w, j in zip(workers, joined) if j["rank"] == 0]
    assert first.wait(timeout=60) == 0, first.output()
    assert events(first, "error"), first.output()
    (restored,) = events(first, "restored")
    assert (restored["step"], restored["value"]) == (1, "one"), restored
    for w in workers:
        w.process.stdin.close()
        assert w.wait(timeout=30) == 0, w.output()


def test_another_jobs_credential_is_refused_before_joining(coordinator_factory):
    import cohort

    coord = coordinator_factory(1)
    other = "cohort-job.v1:other-job:" + "0" * 64
    with pytest.raises(cohort.ControlError) as raised:
        cohort.Group("this-job", coord.endpoint, "w0", token=other)
    assert raised.value.code == "permission_denied", raised.value
    assert "other-job" in str(raised.value)


@pytest.mark.parametrize("transport,expected", [("auto", "shm"), ("tcp", "tcp"), ("shm", "shm")])
def test_the_transport_argument_chooses_the_data_plane(coordinator_factory, spawn, transport, expected):
    coord = coordinator_factory(2, 2)
    workers = [spawn(f"w{r}", "transport.py", coord.endpoint, f"t-{transport}", f"w{r}", transport) for r in range(2)]
    for w in workers:
        assert w.wait(timeout=60) == 0, w.output()
        line = json.loads([text for text in w.output().splitlines() if text.startswith("{")][-1])
        assert line == {"transport": expected, "ok": True, "size": 2}, line


def test_an_unknown_transport_is_refused_before_joining(coordinator_factory):
    import cohort

    coord = coordinator_factory(1)
    with pytest.raises(cohort.InvalidArgumentError, match="auto"):
        cohort.Group("j", coord.endpoint, "w0", transport="carrier-pigeon")
