"""``cohort.torch.managed``: DDP on torch's own gloo, whose membership is cohort's, on real
processes (a coordinator, workers, their gloo sockets): a SIGKILL mid-allreduce with a
replacement ends with the fault-free run's parameters, bit for bit, and the survivor's error
names the dead rank (the coordinator's root cause, not gloo's "Connection closed"); misuse is
refused; a revoked generation's calls raise its root cause. Runs under torch 1.13 and 2.x."""

import json
import re
import signal
import subprocess
import sys
import time

import pytest
from conftest import import_torch
from test_training import EXAMPLE, run_job, summary

torch = import_torch()

ARGS = ("--managed", "--epochs", "2")


def test_ddp_on_managed_gloo_survives_a_kill_mid_allreduce(coordinator_factory, spawn):
    _, clean = run_job(coordinator_factory, spawn, 2, *ARGS, job="managed-clean")
    for w in clean:
        assert w.wait(timeout=240) == 0, w.output()
    reference = summary(clean[0])
    # gloo is the data plane: the default group is the managed backend.
    assert "backend=cohort_gloo" in clean[0].output(), clean[0].output()

    coord, (survivor, victim) = run_job(coordinator_factory, spawn, 2, *ARGS, job="managed-faulty")
    m = victim.wait_for_line(r"^event=allreduce gen=(\d+) rank=(\d+) step=15\b", timeout=180)
    victim_rank = m.group(2)
    victim.kill()
    replacement = spawn(
        "managed-w2",
        [sys.executable, "-u", EXAMPLE],
        "--coordinator",
        coord.endpoint,
        "--job",
        "managed-faulty",
        "--worker-id",
        "w2",
        "--all-ranks-summary",
        *ARGS,
    )
    error = survivor.wait_for_line(r"^event=error .*$", timeout=60).group(0)
    # The root cause is the coordinator's verdict: the killed worker, by rank and worker id.
    assert "cause_worker=w1" in error, error
    assert re.search(rf'cause="rank {victim_rank} \(worker w1\b', error), error
    for w in (survivor, replacement):
        assert w.wait(timeout=300) == 0, w.output()
    finals = [summary(w) for w in (survivor, replacement)]
    assert {s["param_sha256"] for s in finals} == {reference["param_sha256"]}, (finals, reference)
    assert all(int(s["reformations"]) >= 1 for s in finals)


def test_misuse_is_refused_and_a_revoked_generation_raises_its_root_cause(coordinator_factory, spawn):
    coord = coordinator_factory(1, 1)
    w = spawn("misuse", "managed_misuse.py", coord.endpoint, "managed-misuse")
    assert w.wait(timeout=120) == 0, w.output()
    out = w.output()
    assert out.count("ok refused") >= 7, out
    assert out.count("ok report_failure refused") == 4, out
    assert "ok gloo all_reduce backend=cohort_gloo" in out, out
    assert "ok the earlier group's keys deleted" in out, out
    assert "ok after revocation" in out and "declared failed" in out, out
    assert out.rstrip().endswith("done"), out


def test_a_rank_exiting_with_a_managed_call_in_flight_waits_for_it(coordinator_factory, spawn):
    """gloo completes a call on its own thread, running cohort's callback under the GIL: if that
    came during the interpreter's finalization, the process would abort ("terminate called
    without an active exception") after a clean end. So an exit waits (bounded) for the calls in
    flight: rank 0 ends its script with an all_reduce in flight and must still be running, held
    by that call, until rank 1 joins it; both then end cleanly with the right sum."""
    coord = coordinator_factory(2, 2)
    workers = [
        spawn(f"exit-w{i}", "managed_exit.py", coord.endpoint, "managed-exit", f"w{i}", stdin=True) for i in range(2)
    ]
    ranks = {}
    for w in workers:
        ready = json.loads(w.wait_for_line(r'^\{"event": "ready".*$', timeout=120).group(0))
        ranks[ready["rank"]] = w
    first, second = ranks[0], ranks[1]
    first.wait_for_line(r'"event": "exiting"', timeout=60)
    # Without the wait at exit, rank 0 ends within a second of its last line.
    with pytest.raises(subprocess.TimeoutExpired):
        first.process.wait(timeout=3)
    second.process.stdin.close()
    assert second.wait(timeout=60) == 0, second.output()
    assert first.wait(timeout=60) == 0, first.output()
    summed = json.loads(second.wait_for_line(r'^\{"event": "summed".*$', timeout=5).group(0))
    assert summed["values"] == [3.0] * 4, summed


# -- worlds of three ranks (python/tests/workers/managed_world.py: DDP on a small model) -------

WORLD = 3
STEPS = "30"
HOLD_AT = "10"


def world_events(worker, kind):
    lines = worker.output().splitlines()
    return [e for e in (json.loads(line) for line in lines if line.startswith("{")) if e["event"] == kind]


def world_job(coordinator_factory, spawn, job, *, hold=False, spare=False):
    """A job of WORLD ranks (the coordinator holds exactly WORLD) on the managed gloo group;
    with ``hold``, w1 blocks at step HOLD_AT in its first generation (after its forward pass,
    so that the others wait for it inside DDP's allreduce) until its stdin is closed; with
    ``spare``, a fourth process waits to replace a lost rank. (the coordinator, the workers)."""
    coord = coordinator_factory(WORLD, WORLD)
    names = [f"w{i}" for i in range(WORLD + (1 if spare else 0))]
    workers = []
    for name in names:
        held = hold and name == "w1"
        extra = ("--hold-at", HOLD_AT) if held else ()
        workers.append(
            spawn(
                f"{job}-{name}",
                "managed_world.py",
                coord.endpoint,
                job,
                name,
                "--steps",
                STEPS,
                *extra,
                stdin=held,
            )
        )
        if name == f"w{WORLD - 1}" and spare:
            # The spare joins once the first generation formed without it.
            workers[0].wait_for_line(r'"event": "generation"', timeout=120)
    return coord, workers


def done(worker, timeout=180):
    assert worker.wait(timeout=timeout) == 0, worker.output()
    (d,) = world_events(worker, "done")
    return d


@pytest.fixture(scope="module")
def fault_free():
    """The fault-free run's final parameters (computed once, by the first test that needs it)."""
    return {}


def reference(coordinator_factory, spawn, fault_free):
    if "sha256" not in fault_free:
        _, workers = world_job(coordinator_factory, spawn, "world-clean")
        finals = [done(w) for w in workers]
        assert {d["steps"] for d in finals} == {int(STEPS)} and {d["formations"] for d in finals} == {1}, finals
        assert len({d["sha256"] for d in finals}) == 1, finals
        fault_free["sha256"] = finals[0]["sha256"]
    return fault_free["sha256"]


def survivors_name_w1_and_finish_with(survivors, victim_rank, sha256, classes):
    for w in survivors:
        w.wait_for_line(r'"event": "error"', timeout=60)
        err = world_events(w, "error")[0]
        assert err["cls"] in classes, err
        assert err["cause_worker"] == "w1" and err["cause_rank"] == victim_rank, err
        assert f"rank {victim_rank} (worker w1" in err["cause"], err
    finals = [done(w) for w in survivors]
    # Restored to the last commit, re-formed at 3 ranks with the spare, trained on: the
    # fault-free run's parameters, bit for bit, on every rank.
    assert {d["sha256"] for d in finals} == {sha256}, finals
    assert {d["steps"] for d in finals} == {int(STEPS)} and {d["size"] for d in finals} == {WORLD}, finals


def test_three_ranks_on_managed_gloo_survive_a_kill_mid_allreduce(coordinator_factory, spawn, fault_free):
    sha256 = reference(coordinator_factory, spawn, fault_free)
    _, workers = world_job(coordinator_factory, spawn, "world-kill", hold=True, spare=True)
    victim = workers[1]
    held = json.loads(victim.wait_for_line(r'^\{"event": "holding".*$', timeout=120).group(0))
    victim.kill()
    survivors = [w for w in workers if w is not victim]
    # The two live ranks were in the allreduce: gloo's "Connection closed" reported through
    # cohort, whose probe names the dead process; the spare was not in the generation.
    survivors_name_w1_and_finish_with(survivors[:2], held["rank"], sha256, ("PeerFailedError", "RevokedError"))
    assert done(survivors[2])["formations"] == 1  # the spare: one formation, the re-formed one


def test_a_stopped_rank_on_managed_gloo_is_caught_at_its_lease_and_named(coordinator_factory, spawn, fault_free):
    """SIGSTOP: the stopped rank's process holds its gloo sockets open, so gloo never fails;
    its heartbeats stop, its lease (3 s) lapses, the coordinator revokes the generation naming
    it, and the managed watchdog aborts the others' allreduce. SIGCONT afterwards: the stopped
    process finds its generation gone and ends cleanly."""
    sha256 = reference(coordinator_factory, spawn, fault_free)
    _, workers = world_job(coordinator_factory, spawn, "world-stop", hold=True, spare=True)
    victim = workers[1]
    held = json.loads(victim.wait_for_line(r'^\{"event": "holding".*$', timeout=120).group(0))
    victim.signal(signal.SIGSTOP)
    stopped = time.monotonic()
    survivors = [w for w in workers if w is not victim]
    try:
        for w in survivors[:2]:
            w.wait_for_line(r'"event": "error"', timeout=30)
        caught = time.monotonic() - stopped
        # Caught at the lease (3 s), not at gloo's or the watchdog's bound (30 minutes): the
        # coordinator's verdict, the same on both survivors.
        assert caught < 15, caught
        for w in survivors[:2]:
            assert "lease expired" in world_events(w, "error")[0]["cause"], w.output()
        print(f"the stopped rank was caught {caught:.1f} s after SIGSTOP (lease 3 s)")
        survivors_name_w1_and_finish_with(survivors[:2], held["rank"], sha256, ("RevokedError", "PeerFailedError"))
        assert done(survivors[2])["formations"] == 1
    finally:
        victim.signal(signal.SIGCONT)
        victim.process.stdin.close()
    # Let go, the stopped process learns that its generation is over and ends (re-forming into a
    # job that finished without it), bounded.
    assert victim.wait(timeout=60) == 0, victim.output()
    assert not world_events(victim, "done"), victim.output()
