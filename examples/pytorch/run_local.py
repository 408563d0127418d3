#!/usr/bin/env python3
"""One command: the digits example on a local cohort job, fault-free and with a failure.

Starts the embedded coordinator (``cohort-coordinator serve``, memory store) and N workers of
examples/pytorch/digits.py twice: once fault-free, once with one worker SIGKILLed during a
gradient allreduce and a replacement taking its place: by default a hot spare started
before the kill and waiting at the rendezvous (the job is at max_workers), or with
--cold-replacement a process started after the kill (then torch's import, about a second
here, is part of the recovery). Prints both final accuracies and
parameter digests side by side, and the time from the kill to the next training step of the
re-formed job (the model's state synced to the replacement).

    python examples/pytorch/run_local.py [--workers 4] [--epochs 10] [--kill-at 60] [--mode api|ddp|managed]

Binaries: $COHORT_BIN_DIR, else target/release of the checkout. Use the interpreter that has
the cohort package (bash scripts/python-env.sh prints it).
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]


def start_coordinator(workers: int, log: Path) -> tuple[subprocess.Popen, str]:
    bins = Path(os.environ.get("COHORT_BIN_DIR", REPO / "target" / "release"))
    proc = subprocess.Popen(
        [
            str(bins / "cohort-coordinator"),
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--min-workers",
            str(workers),
            "--max-workers",
            str(workers),
            "--elastic-timeout",
            "60s",
            # The test command's sparse pass (python/tests/conftest.py): generations above this
            # size are answered as sparse views.
            *(
                ["--whole-answer-up-to", os.environ["COHORT_TEST_WHOLE_ANSWER_UP_TO"]]
                if os.environ.get("COHORT_TEST_WHOLE_ANSWER_UP_TO")
                else []
            ),
        ],
        stdout=open(log, "w"),
        stderr=subprocess.STDOUT,
    )
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        m = re.search(r"listening on (\S+)", log.read_text())
        if m:
            return proc, f"http://{m.group(1)}"
        if proc.poll() is not None:
            break
        time.sleep(0.02)
    proc.kill()
    raise SystemExit(f"the coordinator did not start: {log.read_text()}")


MODES = {"api": [], "ddp": ["--ddp"], "managed": ["--managed"]}
"""How the workers average gradients: cohort's GradientAverager, DDP on the cohort backend, or
DDP on torch's gloo managed by cohort (digits.py's flags)."""

MODE: list[str] = []


def worker(name: str, coordinator: str, job: str, epochs: int, logdir: Path) -> tuple[subprocess.Popen, Path]:
    log = logdir / f"{job}-{name}.log"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-u",
            str(HERE / "digits.py"),
            "--coordinator",
            coordinator,
            "--job",
            job,
            "--worker-id",
            name,
            "--epochs",
            str(epochs),
            *MODE,
        ],
        stdout=open(log, "w"),
        stderr=subprocess.STDOUT,
    )
    return proc, log


def wait_line(log: Path, pattern: str, timeout: float) -> re.Match:
    deadline = time.monotonic() + timeout
    rx = re.compile(pattern, re.M)
    while time.monotonic() < deadline:
        m = rx.search(log.read_text())
        if m:
            return m
        time.sleep(0.005)
    raise SystemExit(f"no {pattern!r} in {log} after {timeout}s")


def job(name: str, workers: int, epochs: int, kill_at: int | None, logdir: Path, spare: bool = False) -> dict[str, str]:
    coord, endpoint = start_coordinator(workers, logdir / f"{name}-coordinator.log")
    try:
        procs = [worker(f"w{r}", endpoint, name, epochs, logdir) for r in range(workers)]
        extra: dict[str, str] = {}
        if kill_at is not None:
            victim, log = procs[1]
            if spare:
                # A hot spare, started once the first generation trains (else it could take a
                # place in it): it waits at the rendezvous while the job is at max_workers.
                for _, wlog in procs:
                    wait_line(wlog, r"^event=step gen=1 ", 300)
                replacement = worker("w-spare", endpoint, name, epochs, logdir)
            wait_line(log, rf"^event=allreduce gen=\d+ rank=\d+ step={kill_at}\b", 300)
            killed_at = time.time()
            victim.send_signal(signal.SIGKILL)
            procs[1] = replacement if spare else worker("w-replacement", endpoint, name, epochs, logdir)
            cause = wait_line(procs[0][1], r"^event=error .*$", 60).group(0)
            gen = wait_line(procs[0][1], r"^event=generation gen=([2-9]|\d\d+) .*$", 120).group(0)
            step = wait_line(procs[0][1], rf"^event=step gen={gen.split()[1].split('=')[1]} .* t_ms=(\d+)$", 120)
            extra = {
                "killed": "w1",
                "survivor_error": cause.split("event=error ")[1].rsplit(" t_ms", 1)[0],
                "kill_to_next_step_ms": str(int(step.group(1)) - int(killed_at * 1000)),
            }
        for proc, log in procs:
            if proc.wait(timeout=600) != 0:
                raise SystemExit(f"a worker failed: {log.read_text()[-2000:]}")
        for _, log in procs:
            m = re.search(r"^event=summary (.*) t_ms=\d+$", log.read_text(), re.M)
            if m:
                return {**dict(kv.split("=", 1) for kv in m.group(1).split()), **extra}
        raise SystemExit("no summary line")
    finally:
        coord.kill()
        coord.wait(timeout=10)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--kill-at", type=int, default=60, help="the step whose allreduce the kill interrupts")
    ap.add_argument(
        "--cold-replacement",
        action="store_true",
        help="start the replacement after the kill (default: a hot spare waiting at the rendezvous)",
    )
    ap.add_argument(
        "--mode",
        choices=sorted(MODES),
        default="api",
        help="api: cohort's GradientAverager; ddp: DDP on the cohort backend; managed: DDP on torch's gloo "
        "managed by cohort (cohort.torch.managed)",
    )
    args = ap.parse_args()
    MODE[:] = MODES[args.mode]
    logdir = Path(tempfile.mkdtemp(prefix="cohort-digits-"))
    print(f"logs in {logdir}")
    clean = job("fault-free", args.workers, args.epochs, None, logdir)
    faulty = job("with-kill", args.workers, args.epochs, args.kill_at, logdir, spare=not args.cold_replacement)
    print(
        f"fault-free : test_accuracy={clean['test_accuracy']} steps={clean['steps']} "
        f"param_sha256={clean['param_sha256']} step_ms_median={clean['step_ms_median']}"
    )
    print(
        f"with a kill: test_accuracy={faulty['test_accuracy']} steps={faulty['steps']} "
        f"param_sha256={faulty['param_sha256']} reformations={faulty['reformations']}"
    )
    print(f"  the survivor's error: {faulty['survivor_error']}")
    print(f"  kill -9 to the next training step (state synced to the replacement): {faulty['kill_to_next_step_ms']} ms")
    same = clean["param_sha256"] == faulty["param_sha256"]
    print("PASS: the same model as without the failure" if same else "FAIL: the models differ")
    sys.exit(0 if same else 1)


if __name__ == "__main__":
    main()
