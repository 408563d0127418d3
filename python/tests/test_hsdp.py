"""HSDP with a replica group as the unit of failure (``cohort.hsdp``, examples/pytorch/hsdp_ft.py)
on real processes: two replica groups of two ranks, FSDP2 within each group, the gradient
shards averaged across the groups. A rank of one group is SIGKILLed mid-run: the other group
never stops, the failed group re-forms with a spare and rejoins with the live group's state,
and the final parameters match a fault-free run's within float rounding.
Needs torch 2.x (the test command runs it under PyPI's torch; Debian's 1.13 has no FSDP2)."""

import re
import signal
import sys
import time
from pathlib import Path

import pytest
from conftest import import_torch, start_coordinator, torch2_only

torch = import_torch()
torch2_only(torch, "FSDP2", module=True)

EXAMPLE = str(Path(__file__).resolve().parents[2] / "examples" / "pytorch" / "hsdp_ft.py")
STEPS = 120
KILL_AT = 10

JOBS = """
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
"""


def fields(line: str) -> dict[str, str]:
    return dict(kv.split("=", 1) for kv in line.split() if "=" in kv and not kv.startswith('"'))


def events(worker, kind: str) -> list[dict[str, str]]:
    return [fields(m.group(0)) for m in re.finditer(rf"^event={kind} .*$", worker.output(), re.M)]


@pytest.fixture
def coordinator(tmp_path):
    """`coordinator()` starts a coordinator with the jobs above; every one is stopped at the end."""
    settings = tmp_path / "hsdp.toml"
    settings.write_text(JOBS)
    started = []

    def make():
        started.append(start_coordinator(tmp_path, "--config", str(settings)))
        return started[-1]

    yield make
    for c in started:
        c.stop()


def start(spawn, coord, name: str, replica: int, *args: str, managed: bool = False):
    return spawn(
        name,
        [sys.executable, "-u", EXAMPLE],
        "--coordinator",
        coord.endpoint,
        "--replica",
        str(replica),
        "--worker-id",
        name,
        "--steps",
        str(STEPS),
        *args,
        *(["--managed"] if managed else []),
    )


def finished(worker) -> dict[str, str]:
    assert worker.wait(timeout=240) == 0, worker.output()
    done = events(worker, "finished")
    assert len(done) == 1, worker.output()
    return done[0]


def two_groups_and_a_spare(spawn, coordinator, tmp_path, managed=False):
    """Replica 0 (two ranks), replica 1 (two ranks) and a third process for replica 1 that waits
    as its spare (the job holds two): (group 0, replica 1's members, the spare), once replica 1
    formed and every process joined. ``managed``: FSDP2 on torch's gloo managed by cohort."""
    coord = coordinator()
    group0 = [start(spawn, coord, f"r0{w}", 0, "--save", str(tmp_path / f"r0{w}.pt"), managed=managed) for w in "ab"]
    candidates = [
        start(spawn, coord, f"r1{w}", 1, "--save", str(tmp_path / f"r1{w}.pt"), managed=managed) for w in "abc"
    ]
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        members = [w for w in candidates if events(w, "generation")]
        if len(members) == 2 and all(events(w, "joined") for w in candidates):
            break
        time.sleep(0.05)  # polling the workers' output, bounded by the deadline
    else:
        raise AssertionError("replica 1 did not form: " + "\n".join(w.output() for w in candidates))
    (spare,) = [w for w in candidates if w not in members]
    return group0, members, spare


_REFERENCE: dict = {}


def fault_free_parameters(spawn, coordinator, tmp_path):
    """The final parameters of a fault-free run (the same script, the same steps, on the cohort
    backend), made once per session by the first test that asks."""
    if "params" not in _REFERENCE:
        coord = coordinator()
        names = [(r, f"ref{r}{w}") for r in (0, 1) for w in "ab"]
        ref = [start(spawn, coord, name, r, "--save", str(tmp_path / f"{name}.pt")) for r, name in names]
        reference = [finished(w) for w in ref]
        assert {d["step"] for d in reference} == {str(STEPS)}
        assert len({d["params_digest"] for d in reference}) == 1, reference
        assert {d["replica_failures"] for d in reference} == {"0"}
        assert {d["skipped_steps"] for d in reference} == {"0"}
        coord.stop()
        _REFERENCE["params"] = torch.load(tmp_path / "ref0a.pt")
    return _REFERENCE["params"]


def test_a_killed_rank_stops_only_its_replica_group(spawn, coordinator, tmp_path):
    a_killed_rank_stops_only_its_replica_group(spawn, coordinator, tmp_path, managed=False)


def test_on_managed_gloo_a_killed_rank_stops_only_its_replica_group(spawn, coordinator, tmp_path):
    """The same, with FSDP2 on torch's own gloo managed by cohort (cohort.torch.managed): the
    rank is killed while its replica group's FSDP2 collectives run on gloo; the survivor's error
    names it (cohort's root cause, not gloo's "Connection closed")."""
    a_killed_rank_stops_only_its_replica_group(spawn, coordinator, tmp_path, managed=True)


def a_killed_rank_stops_only_its_replica_group(spawn, coordinator, tmp_path, managed):
    want = fault_free_parameters(spawn, coordinator, tmp_path)
    group0, (victim, survivor), spare = two_groups_and_a_spare(spawn, coordinator, tmp_path, managed=managed)
    victim.wait_for_line(rf"^event=step .* step={KILL_AT} ", timeout=120)
    victim.kill()
    killed_ms = time.time() * 1000

    done0 = [finished(w) for w in group0]
    done1 = [finished(w) for w in (survivor, spare)]
    assert victim.wait(timeout=10) != 0

    # Every rank ends at the same step with the same parameters, FSDP2 on the backend asked for.
    assert {d["step"] for d in done0 + done1} == {str(STEPS)}
    assert {d["torch_backend"] for d in done0 + done1} == {"cohort_gloo" if managed else "cohort"}, done0 + done1
    assert len({d["params_digest"] for d in done0 + done1}) == 1, done0 + done1
    # Replica 0 never stopped: no failure, its one replica generation, at most the step in
    # flight skipped, and it trained alone while replica 1 was out, then beside it again.
    for w, d in zip(group0, done0):
        assert d["replica_failures"] == "0" and d["replica_formations"] == "1", w.output()
        assert int(d["skipped_steps"]) <= 1, w.output()
        widths = [e["replicas"] for e in events(w, "step")]
        alone = [i for i, n in enumerate(widths) if n == "1"]
        assert alone and widths[alone[-1] + 1 :] and set(widths[alone[-1] + 1 :]) == {"2"}, widths
        # It did not wait for the dead rank's lease (the default TTL is 10 s): the longest gap
        # between two steps is the failure's detection and one cross-replica re-formation.
        assert float(d["longest_gap_ms"]) < 5000, d
    # The survivor saw its group fail, naming the victim; it and the spare re-formed replica 1.
    errors = events(survivor, "error")
    assert len(errors) == 1 and errors[0]["phase"] == "replica", survivor.output()
    line = survivor.output().split("event=error", 1)[1].splitlines()[0]
    assert victim.name in line, line
    if managed:
        # FSDP2's gloo call failed ("Connection reset"): reported through cohort, whose probe
        # named the dead process; the root cause is the coordinator's, not gloo's. Either this
        # rank's report came first ("root cause: rank R (worker ...") or the revocation from
        # its group-mate's did ("generation G revoked: rank R (worker ..."): both carry it.
        assert re.search(rf"(root cause|revoked): rank \d+ \(worker {victim.name} ", line), line
    assert done1[0]["replica_failures"] == "1" and done1[0]["replica_formations"] == "2"
    # The spare joined at a step boundary with the live group's state (it never started at 0).
    first = int(events(spare, "step")[0]["step"])
    assert first > KILL_AT + 1, spare.output()
    cross = [e for e in events(spare, "generation") if e["job"] == "cross"]
    assert cross and cross[-1]["live"] == "0,1", spare.output()
    after = min(float(e["t_ms"]) for e in events(group0[0], "step") if float(e["t_ms"]) > killed_ms)
    print(
        f"kill at step {KILL_AT}: replica 0's next step {after - killed_ms:.0f} ms after the kill, "
        f"its longest gap {max(float(d['longest_gap_ms']) for d in done0):.0f} ms; "
        f"the spare's first step {first}, "
        f"{float(events(spare, 'step')[0]['t_ms']) - killed_ms:.0f} ms after the kill"
    )

    # The same 64 samples every step, averaged over 4 ranks or over 2: the parameters equal the
    # fault-free run's up to float rounding (the sums are associated differently).
    got = torch.load(tmp_path / "r0a.pt")
    worst = max((a - b).abs().max().item() for a, b in zip(want, got))
    scale = max(a.abs().max().item() for a in want)
    print(f"largest parameter difference from the fault-free run: {worst:.3g} (largest parameter {scale:.3g})")
    assert worst < 1e-4 * scale, worst


def test_sigterm_takes_its_replica_group_out_at_a_step_boundary(spawn, coordinator, tmp_path):
    """A rank that gets SIGTERM (a pod evicted) leaves at the next step boundary: its group
    leaves the cross-replica job with it, the other group re-forms the reduction at that same
    boundary without skipping a step, the leaver exits 0, and nothing counts as a failure."""
    group0, (leaver, stayer), spare = two_groups_and_a_spare(spawn, coordinator, tmp_path)
    leaver.wait_for_line(rf"^event=step .* step={KILL_AT} ", timeout=120)
    leaver.signal(signal.SIGTERM)
    assert leaver.wait(timeout=60) == 0, leaver.output()
    (left,) = events(leaver, "leave")
    assert int(left["step"]) > KILL_AT, leaver.output()
    done = [finished(w) for w in (*group0, stayer, spare)]
    assert {d["step"] for d in done} == {str(STEPS)}
    assert len({d["params_digest"] for d in done}) == 1, done
    assert {d["replica_failures"] for d in done} == {"0"}, done
    assert {d["skipped_steps"] for d in done} == {"0"}, done
    for w in group0:
        widths = [e["replicas"] for e in events(w, "step")]
        assert "1" in widths and widths[-1] == "2", widths
    assert done[2]["replica_formations"] == "2", stayer.output()


def test_a_group_incomplete_in_the_cross_generation_waits_for_the_next(spawn, coordinator, tmp_path):
    """One rank of replica 1 joins the cross-replica job late (held until replica 0 and its own
    group-mate formed a cross generation without it): replica 0 trains alone, the early rank
    takes part only in the per-step agreement, and the next formation admits the whole group
    with replica 0's state."""
    coord = coordinator()
    gate = tmp_path / "gate"
    # Three processes for replica 0: the job holds two, the third waits as a spare that is never
    # needed and leaves (exit 0) when the group finishes.
    candidates0 = [start(spawn, coord, f"r0{w}", 0) for w in "abc"]
    early = start(spawn, coord, "r1a", 1)
    late = spawn(
        "r1b",
        "hsdp_late.py",
        str(gate),
        "--coordinator",
        coord.endpoint,
        "--replica",
        "1",
        "--worker-id",
        "r1b",
        "--steps",
        str(STEPS),
    )
    early.wait_for_line(r"^event=generation .* job=cross replica=1 live=0 ", timeout=120)
    gate.touch()
    for w in candidates0:
        assert w.wait(timeout=240) == 0, w.output()
    (spare,) = [w for w in candidates0 if "reason=spare-not-needed" in w.output()]
    assert not events(spare, "step") and not events(spare, "finished"), spare.output()
    group0 = [w for w in candidates0 if w is not spare]
    done = [finished(w) for w in (*group0, early, late)]
    assert {d["step"] for d in done} == {str(STEPS)}
    assert len({d["params_digest"] for d in done}) == 1, done
    assert {d["replica_failures"] for d in done} == {"0"}, done
    # The early rank saw a cross generation where its group was incomplete, then one with both.
    lives = [e["live"] for e in events(early, "generation") if e["job"] == "cross"]
    assert "0" in lives and lives[-1] == "0,1", lives
    # Replica 0 trained alone meanwhile; replica 1 started from replica 0's state, not from 0.
    assert events(group0[0], "step")[0]["replicas"] == "1"
    assert int(events(late, "step")[0]["step"]) > 1, late.output()


def test_a_group_failed_near_the_end_stops_cleanly_when_the_others_finish_first(spawn, coordinator, tmp_path):
    """A rank of replica 1 is killed one step before the end: replica 0 finishes the job before
    replica 1 (its survivor and the spare) can come back, and replica 1's processes then end
    cleanly (exit 0, a `leave` event saying why), not with "job hsdp.cross has ended" and exit
    1, which a pod's restart policy would loop on."""
    group0, (victim, survivor), spare = two_groups_and_a_spare(spawn, coordinator, tmp_path)
    victim.wait_for_line(rf"^event=step .* step={STEPS - 1} ", timeout=180)
    victim.kill()
    done0 = [finished(w) for w in group0]
    assert {d["step"] for d in done0} == {str(STEPS)}, done0
    for w in (survivor, spare):
        assert w.wait(timeout=180) == 0, w.output()
        assert "has ended" not in "\n".join(line for line in w.output().splitlines() if "Error" in line), w.output()
    leaves = [e for e in events(survivor, "leave") if e.get("reason") == "finished-without-this-group"]
    assert leaves, survivor.output()


def test_a_backend_other_than_cohort_or_gloo_is_refused_before_joining():
    import cohort.hsdp

    with pytest.raises(ValueError, match='backend must be "cohort" or "gloo"'):
        cohort.hsdp.Trainer("hsdp", "http://127.0.0.1:9", 0, "w", build=None, backend="nccl")
