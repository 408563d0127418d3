"""cohort.events, the event-line formatter of the Python workers: it prints what the Rust
parser reads (worker/harness/src/events.rs, whose test checks this module's key table), and every
``emit`` of the workers and examples uses only keys of its kind.

Pure Python: the module is loaded from its file, so these tests need no built extension."""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("cohort_events", REPO / "python" / "cohort" / "events.py")
events = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(events)


def test_lines_are_the_rust_golden_lines():
    # The same lines as worker/harness/src/events.rs's GOLDEN (printed by the Rust structs).
    assert events.line(
        "error",
        gen=4,
        rank=0,
        step=12,
        kind="PeerFailed",
        detail="rank 2: peer closed",
        cause="rank 2 (worker w2 on h): peer closed",
        t_ms=100,
        cause_t_ms=101,
    ) == (
        'event=error gen=4 rank=0 step=12 kind=PeerFailed detail="rank 2: peer closed" '
        'cause="rank 2 (worker w2 on h): peer closed" t_ms=100 cause_t_ms=101'
    )
    assert events.line("leave", gen=0, step=0, joined=False, t_ms=5) == "event=leave gen=0 step=0 joined=false t_ms=5"
    assert (
        events.line("fatal", error='bad "path" C:\\tmp', t_ms=1) == "event=fatal error=\"bad 'path' C:\\\\tmp\" t_ms=1"
    )
    # Keys print in the protocol's order whatever the call's; None leaves an optional key out.
    assert events.line("step", t_ms=9, ms="1.250", step=3, rank=0, world=2, gen=1) == (
        "event=step gen=1 world=2 rank=0 step=3 ms=1.250 t_ms=9"
    )
    assert events.line("error", gen=1, rank=0, step=None, phase="sync", kind="Revoked", cause="x", t_ms=2) == (
        'event=error gen=1 rank=0 phase=sync kind=Revoked cause="x" t_ms=2'
    )


def test_extra_keys_go_before_t_ms_and_unknown_ones_are_refused():
    assert events.line("step", gen=1, world=2, rank=0, step=3, extra={"loss": "0.5"}, t_ms=9) == (
        "event=step gen=1 world=2 rank=0 step=3 loss=0.5 t_ms=9"
    )
    with pytest.raises(ValueError, match="no key wrld"):
        events.line("step", gen=1, wrld=2)
    with pytest.raises(ValueError, match="unknown event kind"):
        events.line("teleported", gen=1)
    with pytest.raises(ValueError, match="key of the protocol"):
        events.line("step", extra={"gen": 1})


def test_every_kind_has_t_ms_and_the_table_parses():
    for kind in events.KEYS:
        names = [k.name for k in events.keys(kind)]
        assert "t_ms" in names, kind
        assert len(set(names)) == len(names), kind


def _emits(path: Path):
    """(line, kind, keyword names) of every `emit("kind", ...)` call in `path`."""
    for node in ast.walk(ast.parse(path.read_text())):
        if (
            isinstance(node, ast.Call)
            and getattr(node.func, "id", getattr(node.func, "attr", None)) == "emit"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            yield node.lineno, node.args[0].value, [k.arg for k in node.keywords if k.arg not in (None, "extra")]


@pytest.mark.parametrize(
    "path",
    sorted((REPO / "python" / "tests" / "workers").glob("*.py")) + sorted((REPO / "examples").rglob("*.py")),
    ids=lambda p: p.name,
)
def test_workers_and_examples_emit_only_keys_of_the_protocol(path):
    for lineno, kind, keys in _emits(path):
        names = [k.name for k in events.keys(kind)]
        unknown = [k for k in keys if k not in names]
        assert not unknown, f"{path.name}:{lineno}: event={kind} has no key {unknown} (its keys: {names})"


def test_the_workers_print_through_the_formatter():
    # No hand-built event line is left: every `event=` a worker or an example prints goes
    # through cohort.events.
    paths = sorted((REPO / "python" / "tests" / "workers").glob("*.py")) + sorted((REPO / "examples").rglob("*.py"))
    for path in paths:
        for call in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(call, ast.Call) and getattr(call.func, "id", None) == "print"):
                continue
            for node in ast.walk(call):
                if isinstance(node, ast.Constant) and isinstance(node.value, str) and "event=" in node.value:
                    pytest.fail(f"{path.name}:{node.lineno}: a hand-built event line {node.value[:40]!r}")
