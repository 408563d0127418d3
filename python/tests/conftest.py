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


NOT_APPLICABLE = "not applicable here: "
"""The start of the one skip reason allowed under COHORT_REQUIRE_PYTHON (see :func:`not_applicable`)."""


def not_applicable(reason: str, *, module: bool = False) -> None:
    """Skips the calling test (``module``: the whole module) because it cannot apply to this
    interpreter, saying why: a torch-2.x-only test under torch 1.13, say. Such skips are
    counted and listed at the end of the run; under COHORT_REQUIRE_PYTHON every other skip
    is a failure (a test whose requirement is missing where it should be present must not
    pass silently)."""
    pytest.skip(NOT_APPLICABLE + reason, allow_module_level=module)


def torch2_only(torch, what: str, *, module: bool = False) -> None:
    """:func:`not_applicable` under torch 1.x: ``what`` needs torch 2.x."""
    if int(torch.__version__.split(".")[0]) < 2:
        not_applicable(f"{what} needs torch 2.x (this is torch {torch.__version__})", module=module)


def _skip_reason(report) -> str:
    longrepr = report.longrepr
    return longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)


def _refuse_unexpected_skip(report) -> None:
    """Under COHORT_REQUIRE_PYTHON, a skip that is not :func:`not_applicable` fails."""
    if not (os.environ.get("COHORT_REQUIRE_PYTHON") and report.skipped):
        return
    reason = _skip_reason(report)
    if NOT_APPLICABLE in reason:
        return
    report.outcome = "failed"
    report.longrepr = (
        f"unexpected skip under COHORT_REQUIRE_PYTHON: {reason}\n(a test that cannot apply to this interpreter "
        "says so with conftest.not_applicable(reason); any other skip means a requirement is missing)"
    )


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    _refuse_unexpected_skip(outcome.get_result())


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    outcome = yield
    _refuse_unexpected_skip(outcome.get_result())


def pytest_terminal_summary(terminalreporter) -> None:
    """Counts and lists the tests that were not applicable, with their reasons."""
    reasons: dict[str, int] = {}
    for report in terminalreporter.stats.get("skipped", []):
        reason = _skip_reason(report)
        if NOT_APPLICABLE in reason:
            reason = reason.split(NOT_APPLICABLE, 1)[1]
            reasons[reason] = reasons.get(reason, 0) + 1
    if reasons:
        terminalreporter.write_line(f"{sum(reasons.values())} not applicable:")
        for reason, count in sorted(reasons.items()):
            terminalreporter.write_line(f"  {count} x {reason}")


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


def coordinator_address(output: str) -> Optional[str]:
    """The gRPC address a coordinator announced in its stdout (the line
    ``cohort-coordinator listening on ADDR``, written by coordinator/src/announce.rs), if it
    has yet. The one reader of that line in the Python tests."""
    m = re.search(r"^cohort-coordinator listening on (\S+)$", output, re.MULTILINE)
    return m.group(1) if m else None


WHOLE_ANSWER_UP_TO = "COHORT_TEST_WHOLE_ANSWER_UP_TO"
"""An environment variable: when set (to a number), every coordinator the tests start answers
generations larger than it as sparse views (``--whole-answer-up-to``), unless the test sets
that flag itself. scripts/test.sh sets it to 1 for the torch 1.13 pass, so that every test that
forms a group there runs on the sparse path (docs/testing.md)."""


def sparse_args(args: Sequence[str]) -> list[str]:
    """``--whole-answer-up-to $COHORT_TEST_WHOLE_ANSWER_UP_TO`` when that is set and ``args``
    do not choose the threshold themselves; else nothing."""
    value = os.environ.get(WHOLE_ANSWER_UP_TO, "").strip()
    if not value or any(a == "--whole-answer-up-to" or a.startswith("--whole-answer-up-to=") for a in args):
        return []
    return ["--whole-answer-up-to", value]


def start_coordinator(tmp: Path, *args: str, timeout: float = 20.0) -> Coordinator:
    """Starts a coordinator on 127.0.0.1:0 and waits (bounded) for its bound address (with
    :func:`sparse_args`)."""
    log = tmp / f"coordinator-{time.monotonic_ns()}.log"
    out = open(log, "w")
    proc = subprocess.Popen(
        [str(binary("cohort-coordinator")), "serve", "--listen", "127.0.0.1:0", *args, *sparse_args(args)],
        stdout=out,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        address = coordinator_address(log.read_text())
        if address:
            return Coordinator(proc, address, log)
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
