"""The PyTorch example on real processes: the high-level API, DDP on the "cohort" backend,
and SIGKILLed workers replaced mid-training."""

import sys
from pathlib import Path

from conftest import import_torch

# Debian's python3-torch, installed by scripts/ensure-deps.sh (or PyPI's torch 2.x in
# target/pyenv-torch2). Without it these tests skip, unless COHORT_REQUIRE_PYTHON is set.
torch = import_torch()

EXAMPLE = str(Path(__file__).resolve().parents[2] / "examples" / "pytorch" / "digits.py")
LOADER = str(Path(__file__).resolve().parents[2] / "examples" / "pytorch" / "ddp_loader.py")


def summary(worker):
    m = worker.wait_for_line(r"^event=summary .*$", timeout=5)
    return dict(kv.split("=", 1) for kv in m.group(0).split()[1:])


def run_job(coordinator_factory, spawn, world, *args, job="digits"):
    coord = coordinator_factory(world, world, "--elastic-timeout", "60s")
    workers = [
        spawn(
            f"{job}-w{r}",
            [sys.executable, "-u", EXAMPLE],
            "--coordinator",
            coord.endpoint,
            "--job",
            job,
            "--worker-id",
            f"w{r}",
            "--all-ranks-summary",
            *args,
        )
        for r in range(world)
    ]
    return coord, workers


def single(spawn, *args):
    w = spawn("single", [sys.executable, "-u", EXAMPLE], "--world", "1", *args)
    assert w.wait(timeout=120) == 0, w.output()
    return summary(w)


def test_two_workers_high_level_and_ddp_give_the_same_parameters(coordinator_factory, spawn):
    results = {}
    for mode in ("api", "ddp"):
        _, workers = run_job(
            coordinator_factory, spawn, 2, "--epochs", "2", *(["--ddp"] if mode == "ddp" else []), job=f"pair-{mode}"
        )
        sums = []
        for w in workers:
            assert w.wait(timeout=180) == 0, w.output()
            sums.append(summary(w))
        assert sums[0]["param_sha256"] == sums[1]["param_sha256"], sums
        assert all(s["ranks_agree"] == "true" for s in sums)
        results[mode] = sums[0]
    # Averaging in cohort's buckets and through DDP's reducer on the cohort backend compute
    # the same bits (halving is exact, so the division's place does not matter at 2 ranks).
    assert results["api"]["param_sha256"] == results["ddp"]["param_sha256"], results


def test_ddp_fed_by_a_dataloader_with_workers_matches_gloo(spawn):
    # The busy-cores benchmark's job (docs/benchmarks-journal.md): DDP with DataLoader(num_workers=2)
    # on each backend, one epoch; both must end with the same parameters.
    lines = {}
    for backend in ("gloo", "cohort"):
        w = spawn(
            f"loader-{backend}",
            [sys.executable, "-u", LOADER],
            "--backend",
            backend,
            "--world",
            "2",
            "--loader-workers",
            "2",
            "--epochs",
            "1",
            "--timeout",
            "150",
        )
        assert w.wait(timeout=180) == 0, w.output()
        m = w.wait_for_line(r"^peer=.*$", timeout=5)
        lines[backend] = dict(kv.split("=", 1) for kv in m.group(0).split())
    assert lines["cohort"]["steps"] == "23", lines
    assert lines["cohort"]["param_sha256"] == lines["gloo"]["param_sha256"], lines


def test_four_workers_match_one_process_with_the_same_global_batch(coordinator_factory, spawn):
    _, workers = run_job(coordinator_factory, spawn, 4, "--epochs", "3", job="four")
    sums = []
    for w in workers:
        assert w.wait(timeout=240) == 0, w.output()
        sums.append(summary(w))
    assert len({s["param_sha256"] for s in sums}) == 1, "bit-identical parameters on every rank"
    base = single(spawn, "--epochs", "3")
    # Same global batch and data: the same model up to floating-point summation order.
    assert abs(float(sums[0]["test_accuracy"]) - float(base["test_accuracy"])) <= 0.02, (sums[0], base)
    assert int(sums[0]["steps"]) == int(base["steps"])


def test_kills_mid_allreduce_with_replacements_change_nothing(coordinator_factory, spawn):
    """Two SIGKILLs during gradient allreduces, a replacement after each: the job finishes with
    the same parameters as a fault-free run, every survivor names the killed worker."""
    epochs = ("--epochs", "3")
    _, clean = run_job(coordinator_factory, spawn, 4, *epochs, job="clean")
    for w in clean:
        assert w.wait(timeout=240) == 0, w.output()
    reference = summary(clean[0])

    coord, workers = run_job(coordinator_factory, spawn, 4, *epochs, job="faulty")
    live = list(workers)
    for victim_index, at_step, replacement in ((1, 20, "w4"), (2, 45, "w5")):
        victim = live[victim_index]
        victim.wait_for_line(rf"^event=allreduce gen=\d+ rank=\d+ step={at_step}\b", timeout=180)
        victim.kill()
        live.remove(victim)
        live.append(
            spawn(
                replacement,
                [sys.executable, "-u", EXAMPLE],
                "--coordinator",
                coord.endpoint,
                "--job",
                "faulty",
                "--worker-id",
                replacement,
                "--all-ranks-summary",
                *epochs,
            )
        )
        killed = victim.process.args[victim.process.args.index("--worker-id") + 1]
        for w in live[:-1]:
            m = w.wait_for_line(rf"^event=error .*cause_worker={killed}\b.*$", timeout=60)
            assert "cause=" in m.group(0)
    for w in live:
        assert w.wait(timeout=300) == 0, w.output()
    finals = [summary(w) for w in live]
    assert len({s["param_sha256"] for s in finals}) == 1, finals
    # The world stayed 4 with the same global batches: recovery restored the exact commits.
    assert finals[0]["param_sha256"] == reference["param_sha256"], (finals[0], reference)
    assert finals[0]["test_accuracy"] == reference["test_accuracy"]
    assert all(int(s["reformations"]) >= 1 for s in finals)


def test_ddp_on_the_cohort_backend_survives_a_kill(coordinator_factory, spawn):
    """DDP (``--ddp``: DistributedDataParallel on the "cohort" backend) with a worker SIGKILLed
    mid-training and a replacement: the survivor's DDP step raises the failure (it used to crash
    torch 2.x's reducer, which read a failed future's exception as the reduced tensors), the
    job restores the last commit and ends with the fault-free run's parameters."""
    args = ("--ddp", "--epochs", "2")
    _, clean = run_job(coordinator_factory, spawn, 2, *args, job="ddp-clean")
    for w in clean:
        assert w.wait(timeout=240) == 0, w.output()
    reference = summary(clean[0])

    coord, (survivor, victim) = run_job(coordinator_factory, spawn, 2, *args, job="ddp-faulty")
    victim.wait_for_line(r"^event=allreduce gen=\d+ rank=\d+ step=15\b", timeout=180)
    victim.kill()
    replacement = spawn(
        "ddp-w2",
        [sys.executable, "-u", EXAMPLE],
        "--coordinator",
        coord.endpoint,
        "--job",
        "ddp-faulty",
        "--worker-id",
        "w2",
        "--all-ranks-summary",
        *args,
    )
    survivor.wait_for_line(r"^event=error .*cause_worker=w1\b.*$", timeout=60)
    for w in (survivor, replacement):
        assert w.wait(timeout=300) == 0, w.output()
    finals = [summary(w) for w in (survivor, replacement)]
    assert {s["param_sha256"] for s in finals} == {reference["param_sha256"]}, (finals, reference)
