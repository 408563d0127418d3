"""A busy rank is not a hung rank (docs/failure-semantics.md, "Late ranks"), over real
processes and with the defaults: a rank that writes a 60 s checkpoint between two allreduces
is waited for, over TCP and over shared memory; a rank that computes forever is caught at the
late-rank bound, and the root cause says that it was computing, not stopped."""

import json

import pytest
from conftest import import_torch

# As long as the scenario: a minute, six times the default no-progress ceiling.
CHECKPOINT_SECONDS = 60


def events(worker, kind):
    lines = worker.output().splitlines()
    return [e for e in (json.loads(line) for line in lines if line.startswith("{")) if e["event"] == kind]


@pytest.mark.parametrize("transport,kind", [("tcp", "sleep"), ("shm", "burn")])
def test_a_rank_checkpointing_for_a_minute_is_waited_for(coordinator_factory, spawn, transport, kind):
    coord = coordinator_factory(2, 2)
    workers = [
        spawn(
            f"{transport}-w{r}",
            "late_rank.py",
            "checkpoint",
            coord.endpoint,
            f"late-{transport}",
            f"w{r}",
            transport,
            str(CHECKPOINT_SECONDS),
            kind,
            # The waiting rank's calm "waiting on rank 1" lines are at info level.
            env={"COHORT_LOG": "warn,cohort_transports=info"},
        )
        for r in range(2)
    ]
    for w in workers:
        assert w.wait(timeout=CHECKPOINT_SECONDS + 90) == 0, w.output()
        assert not events(w, "error"), w.output()
        joined = events(w, "joined")[0]
        assert joined["transport"] == transport, joined
        done = events(w, "done")[0]
        # One generation: no revocation, no re-formation.
        assert done["generation"] == joined["generation"], (joined, done)
    waiting = next(w for w in workers if events(w, "joined")[0]["rank"] == 1)
    # Rank 1 really waited out the checkpoint inside the fourth allreduce, past the 10 s ceiling.
    assert events(waiting, "done")[0]["waited"] >= CHECKPOINT_SECONDS - 1, waiting.output()
    # And said whom it waited for, at a calm rate (every 10 s), not once per probe.
    said = waiting.output().count("waiting on rank")
    assert 1 <= said <= CHECKPOINT_SECONDS // 10 + 2, waiting.output()


def test_a_rank_computing_forever_is_caught_at_the_late_rank_bound(coordinator_factory, spawn):
    # Above the 10 s no-progress ceiling (the late-rank bound is never shorter than it).
    bound = 12
    coord = coordinator_factory(2, 2)
    workers = [
        spawn(f"w{r}", "late_rank.py", "endless", coord.endpoint, "late-endless", f"w{r}", "tcp", str(bound))
        for r in range(2)
    ]
    for w in workers:
        w.wait_for_line(r'"step": 2\b', timeout=60)
    endless = next(w for w in workers if events(w, "joined")[0]["rank"] == 1)
    waiting = next(w for w in workers if w is not endless)
    waiting.wait_for_line(r'"event": "error"', timeout=bound + 60)
    err = events(waiting, "error")[0]
    assert err["cause_worker"] == endless.name, err
    assert err["cause_rank"] == 1, err
    # Running and computing, named as such: not "stopped", not a bare timeout.
    assert "runs" in err["reason"] and "computing" in err["reason"], err
    assert "stopped" not in err["reason"], err
    assert f"no progress for {bound * 1000} ms" in err["reason"], err


def test_ddp_with_rank_0_checkpointing_for_a_minute_between_steps(coordinator_factory, spawn, tmp_path):
    import_torch()
    coord = coordinator_factory(2, 2)
    workers = [
        spawn(f"ddp-w{r}", "late_ddp.py", coord.endpoint, "late-ddp", f"w{r}", str(CHECKPOINT_SECONDS), str(tmp_path))
        for r in range(2)
    ]
    for w in workers:
        assert w.wait(timeout=CHECKPOINT_SECONDS + 120) == 0, w.output()
    done = [events(w, "done")[0] for w in workers]
    assert done[0]["digest"] == done[1]["digest"], done
    assert done[0]["generation"] == done[1]["generation"], done
    assert (tmp_path / "model.pt").exists()
    waiting = next(d for d in done if d["rank"] == 1)
    assert waiting["waited"] >= CHECKPOINT_SECONDS - 1, done
