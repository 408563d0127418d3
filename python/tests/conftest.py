"""Shared fixtures: a real coordinator process on a free loopback port, and real worker
processes. Every wait is bounded; every process started is stopped."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Optional, Sequence

import pytest

REPO = Path(__file__).resolve().parents[2]


def import_torch():
    """torch, or a skip of the calling test (module) when it is not installed; a failure instead
    when COHORT_REQUIRE_PYTHON is set (scripts/test.sh sets it), so CI never passes with the
    PyTorch tests skipped."""
    if os.environ.get("COHORT_REQUIRE_PYTHON"):
        import torch

        return torch
    return pytest.importorskip("torch")


WORKERS = Path(__file__).resolve().parent / "workers"


def binary(name: str) -> Path:
    """A cohort binary: $COHORT_BIN_DIR, else target/release, else target/debug."""
    dirs = [os.environ.get("COHORT_BIN_DIR", ""), str(REPO / "target" / "release"), str(REPO / "target" / "debug")]
    for d in dirs:
        if d and (Path(d) / name).is_file():
            return Path(d) / name
    raise FileNotFoundError(f"{name} not built (cargo build -p cohort-coordinator), looked in {dirs}")


@dataclass
class Coordinator:
    """A running `cohort-coordinator serve` process."""

    process: subprocess.Popen
    address: str
    log: Path

    @property
    def endpoint(self) -> str:
        return f"http://{self.address}"

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(timeout=10)


def start_coordinator(tmp: Path, *args: str, timeout: float = 20.0) -> Coordinator:
    """Starts a coordinator on 127.0.0.1:0 and waits (bounded) for its bound address."""
    log = tmp / f"coordinator-{time.monotonic_ns()}.log"
    out = open(log, "w")
    proc = subprocess.Popen(
        [str(binary("cohort-coordinator")), "serve", "--listen", "127.0.0.1:0", *args],
        stdout=out,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        m = re.search(r"listening on (\S+)", log.read_text())
        if m:
            return Coordinator(proc, m.group(1), log)
        if proc.poll() is not None:
            raise RuntimeError(f"coordinator exited: {log.read_text()}")
        time.sleep(0.02)  # polling a log file for a line: bounded by the deadline above
    proc.kill()
    raise TimeoutError(f"coordinator did not print its address in {timeout}s: {log.read_text()}")


@pytest.fixture
def coordinator_factory(tmp_path: Path) -> Iterator:
    """`make(min_workers, max_workers, *extra_args)` -> Coordinator; all stopped at the end."""
    started: list[Coordinator] = []

    def make(min_workers: int, max_workers: Optional[int] = None, *extra: str) -> Coordinator:
        c = start_coordinator(
            tmp_path,
            "--min-workers",
            str(min_workers),
            "--max-workers",
            str(max_workers or min_workers),
            "--join-window",
            "200ms",
            *extra,
        )
        started.append(c)
        return c

    yield make
    for c in started:
        c.stop()


@dataclass
class Worker:
    """A worker process running a script of python/tests/workers/ (or any argv)."""

    name: str
    process: subprocess.Popen
    log: Path
    started: float = field(default_factory=time.monotonic)

    def output(self) -> str:
        return self.log.read_text()

    def wait(self, timeout: float) -> int:
        try:
            return self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=10)
            raise AssertionError(f"worker {self.name} did not finish in {timeout}s; output:\n{self.output()}") from None

    def wait_for_line(self, pattern: str, timeout: float) -> re.Match:
        """Polls the worker's output for a line matching `pattern` (bounded)."""
        deadline = time.monotonic() + timeout
        rx = re.compile(pattern, re.M)
        while time.monotonic() < deadline:
            m = rx.search(self.output())
            if m:
                return m
            if self.process.poll() is not None:
                m = rx.search(self.output())
                if m:
                    return m
                raise AssertionError(
                    f"worker {self.name} exited ({self.process.returncode}) before {pattern!r}:\n{self.output()}"
                )
            time.sleep(0.01)
        raise AssertionError(f"worker {self.name}: no {pattern!r} in {timeout}s; output:\n{self.output()}")

    def signal(self, sig: int) -> None:
        if self.process.poll() is None:
            os.kill(self.process.pid, sig)

    def kill(self) -> None:
        self.signal(signal.SIGKILL)


@pytest.fixture
def spawn(tmp_path: Path) -> Iterator:
    """`spawn(name, argv_or_script, *args, env=None, stdin=False)` -> Worker (stdin=True gives
    it a pipe: closing `worker.process.stdin` is its cue); every one killed at the end."""
    workers: list[Worker] = []

    def start(
        name: str, script: str | Sequence[str], *args: str, env: Optional[dict] = None, stdin: bool = False
    ) -> Worker:
        argv = (
            [sys.executable, "-u", str(WORKERS / script), *args]
            if isinstance(script, str)
            else list(script) + list(args)
        )
        log = tmp_path / f"{name}.log"
        proc = subprocess.Popen(
            argv,
            stdout=open(log, "w"),
            stderr=subprocess.STDOUT,
            cwd=str(REPO),
            env={**os.environ, **(env or {})},
            stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
        )
        w = Worker(name, proc, log)
        workers.append(w)
        return w

    yield start
    for w in workers:
        if w.process.poll() is None:
            w.process.kill()
            w.process.wait(timeout=10)
