"""``cohort.torch.managed``: DDP on torch's own gloo, whose membership is cohort's, on real
processes (a coordinator, workers, their gloo sockets): a SIGKILL mid-allreduce with a
replacement ends with the fault-free run's parameters, bit for bit, and the survivor's error
names the dead rank (the coordinator's root cause, not gloo's "Connection closed"); misuse is
refused; a revoked generation's calls raise its root cause. Runs under torch 1.13 and 2.x."""

import re
import sys

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
    assert "ok after revocation" in out and "declared failed" in out, out
    assert out.rstrip().endswith("done"), out
