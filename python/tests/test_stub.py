"""The stub ``cohort/_native.pyi`` is checked against the extension itself, as mypy's stubtest
would: the same public names in the module and in each class, and for every function and
method whose signature the extension publishes (PyO3's ``__text_signature__``) the same
parameters, in the same order, of the same kinds, with the same defaults. A method added,
renamed or re-signed on one side only fails here."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path
from typing import Any, Optional

import pytest

import cohort
import cohort._native as native

STUB = Path(cohort.__file__).resolve().parent / "_native.pyi"
TREE = ast.parse(STUB.read_text(), filename=str(STUB))
# Names the stub defines for its own annotations only (type aliases), and what it imports.
ALIASES = {t.id for node in TREE.body if isinstance(node, ast.Assign) for t in node.targets if isinstance(t, ast.Name)}
IMPORTED = {a.asname or a.name for node in TREE.body if isinstance(node, ast.ImportFrom) for a in node.names}
# What every class has without declaring it.
INHERITED = set(dir(object))


def stub_names(body: list[ast.stmt]) -> dict[str, Optional[ast.FunctionDef]]:
    """Public names declared in a stub body: functions and classes (with their node) and
    annotated attributes (None)."""
    names: dict[str, Any] = {}
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names[node.name] = node
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names[node.target.id] = None
    return names


def public(names: set[str]) -> set[str]:
    return {n for n in names if not n.startswith("_")}


def stub_parameters(fn: ast.FunctionDef, method: bool) -> list[tuple[str, inspect._ParameterKind, Any]]:
    """(name, kind, default) of each parameter the stub declares (``self`` dropped); a default
    that is not a literal is ``...``."""
    a = fn.args
    out: list[tuple[str, inspect._ParameterKind, Any]] = []

    def default_of(node: Optional[ast.expr]) -> Any:
        if node is None:
            return inspect.Parameter.empty
        try:
            return ast.literal_eval(node)
        except ValueError:
            return ...

    positional = a.posonlyargs + a.args
    defaults = [None] * (len(positional) - len(a.defaults)) + list(a.defaults)
    for i, (arg, d) in enumerate(zip(positional, defaults)):
        kind = inspect.Parameter.POSITIONAL_ONLY if i < len(a.posonlyargs) else inspect.Parameter.POSITIONAL_OR_KEYWORD
        out.append((arg.arg, kind, default_of(d)))
    if a.vararg:
        out.append((a.vararg.arg, inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.empty))
    for arg, d in zip(a.kwonlyargs, a.kw_defaults):
        out.append((arg.arg, inspect.Parameter.KEYWORD_ONLY, default_of(d)))
    if a.kwarg:
        out.append((a.kwarg.arg, inspect.Parameter.VAR_KEYWORD, inspect.Parameter.empty))
    if method and out and out[0][0] == "self":
        out = out[1:]
    return out


def runtime_parameters(obj: Any) -> Optional[list[tuple[str, inspect._ParameterKind, Any]]]:
    """The same, from the signature the extension publishes; None when it publishes none."""
    try:
        sig = inspect.signature(obj)
    except (ValueError, TypeError):
        return None
    params = list(sig.parameters.values())
    if params and params[0].name in ("self", "$self", "cls", "$cls"):
        params = params[1:]
    return [(p.name, p.kind, p.default) for p in params]


def same_signature(where: str, stub: list, runtime: list) -> None:
    assert [(n, k) for n, k, _ in stub] == [(n, k) for n, k, _ in runtime], f"{where}: stub {stub}, extension {runtime}"
    for (name, _, s), (_, _, r) in zip(stub, runtime):
        # `...` on either side: a default one side cannot spell as a literal.
        if s is ... or r is ...:
            assert (s is inspect.Parameter.empty) == (r is inspect.Parameter.empty), f"{where}({name}): default"
            continue
        assert s == r, f"{where}({name}): stub default {s!r}, extension default {r!r}"


def test_the_module_declares_what_the_extension_has():
    declared = public(set(stub_names(TREE.body))) - ALIASES - IMPORTED
    present = public(set(dir(native)))
    assert declared == present, f"only in the stub: {declared - present}; only in the extension: {present - declared}"
    assert "__version__" in stub_names(TREE.body) and isinstance(native.__version__, str)


CLASSES = [node for node in TREE.body if isinstance(node, ast.ClassDef)]


@pytest.mark.parametrize("node", CLASSES, ids=[c.name for c in CLASSES])
def test_each_class_declares_what_the_extension_has(node: ast.ClassDef):
    cls = getattr(native, node.name)
    declared = stub_names(node.body)
    present = public(set(dir(cls)) - INHERITED)
    assert public(set(declared)) == present, (
        f"{node.name}: only in the stub: {public(set(declared)) - present}; "
        f"only in the extension: {present - public(set(declared))}"
    )
    for name in declared:
        if name.startswith("__") and name != "__init__":
            assert hasattr(cls, name), f"{node.name}.{name} is in the stub, not in the extension"


SIGNED = [(None, node) for node in TREE.body if isinstance(node, ast.FunctionDef)] + [
    (c.name, f) for c in CLASSES for f in c.body if isinstance(f, ast.FunctionDef)
]


@pytest.mark.parametrize("owner,fn", SIGNED, ids=[f"{o or 'module'}.{f.name}" for o, f in SIGNED])
def test_each_signature_matches_the_extension(owner: Optional[str], fn: ast.FunctionDef):
    if owner is None:
        target: Any = getattr(native, fn.name)
    elif fn.name == "__init__":
        # An extension class publishes its constructor's signature on the class.
        target = getattr(native, owner)
    else:
        target = getattr(getattr(native, owner), fn.name)
    runtime = runtime_parameters(target)
    if runtime is None:
        assert fn.name.startswith("__") and fn.name != "__init__", (
            f"{owner}.{fn.name}: the extension publishes no signature"
        )
        return
    same_signature(f"{owner or 'cohort._native'}.{fn.name}", stub_parameters(fn, owner is not None), runtime)


def test_group_config_is_what_the_stub_and_group_take():
    """``GroupConfig`` is a frozen dataclass (the stub imports it from ``cohort.config``);
    every field has a default but the first two."""
    import dataclasses

    fields = dataclasses.fields(cohort.GroupConfig)
    required = [f.name for f in fields if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    assert required == ["job", "coordinator"]
    config = cohort.GroupConfig("j", "http://127.0.0.1:1")
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.job = "other"  # type: ignore[misc]
    assert "GroupConfig" in IMPORTED
