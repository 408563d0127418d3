"""``cohort.torch.Store``: torch's c10d ``Store`` on a real coordinator process (its
``StoreOp`` RPC), on torch 1.13 and torch 2.x: every operation, compare_set as ``TCPStore``
answers it, timeouts, bad input and a wrong credential refused with nothing changed, and two
gloo ranks that rendezvous through it (``init_process_group("gloo", store=...)``) and
allreduce."""

from __future__ import annotations

import datetime
import signal
import subprocess
import time

import pytest
from conftest import binary, import_torch, start_coordinator

torch = import_torch()
dist = torch.distributed

import cohort  # noqa: E402
import cohort.torch  # noqa: E402
from cohort.errors import ControlError, InvalidArgumentError  # noqa: E402

SECRET = "store test secret"


@pytest.fixture
def secured(tmp_path, monkeypatch):
    """A coordinator that requires credentials, and the credential of job ``kv``."""
    secret = tmp_path / "secret"
    secret.write_text(SECRET)
    coord = start_coordinator(tmp_path, "--token-file", str(secret))
    credential = subprocess.run(
        [str(binary("cohort-coordinator")), "credential", "--job", "kv", "--token-file", str(secret)],
        check=True,
        capture_output=True,
        text=True,
        timeout=30,
    ).stdout.strip()
    yield coord, credential
    coord.stop()


def store(coord, credential, scope="g1", job="kv", **kw):
    return cohort.torch.Store(job, coord.endpoint, token=credential, scope=scope, **kw)


def timeout_error():
    return getattr(dist, "DistStoreError", RuntimeError)


def test_the_store_is_a_torch_store(secured):
    coord, credential = secured
    s = store(coord, credential)
    assert isinstance(s, dist.Store)
    assert cohort.__file__.startswith(str(__import__("pathlib").Path(__file__).resolve().parents[1])), cohort.__file__


def test_every_operation(secured):
    coord, credential = secured
    s = store(coord, credential, timeout=datetime.timedelta(seconds=30))
    assert s.timeout == datetime.timedelta(seconds=30)
    s.set("a", b"alpha")
    assert s.get("a") == b"alpha"
    s.set("text", "utf-8 é")
    assert s.get("text") == "utf-8 é".encode()
    assert s.check(["a", "text"]) and not s.check(["a", "missing"])
    assert s.num_keys() == 2
    assert s.add("n", 2) == 2 and s.add("n", 5) == 7 and s.add("n", -10) == -3
    assert s.get("n") == b"-3"
    with pytest.raises(ControlError) as info:
        s.add("a", 1)
    assert info.value.code == "failedprecondition" and "not an integer" in str(info.value)
    # compare_set, as TCPStore answers it.
    assert s.compare_set("cs", b"x", b"y") == b"x" and not s.check(["cs"])
    assert s.compare_set("cs", b"", b"first") == b"first"
    assert s.compare_set("cs", b"wrong", b"z") == b"first"
    assert s.compare_set("cs", b"first", b"second") == b"second" and s.get("cs") == b"second"
    assert s.delete_key("cs") and not s.delete_key("cs")
    assert s.num_keys() == 3
    # Scopes and jobs keep apart.
    other = store(coord, credential, scope="g2")
    assert other.num_keys() == 0 and not other.check(["a"])
    s.wait(["a", "n"])
    s.wait(["a"], datetime.timedelta(seconds=1))


def test_append_multi_get_and_multi_set(secured):
    """torch 2.x's extended Store API: append (one compare-and-swap at the coordinator),
    multi_get (waits for every key), multi_set; through torch's own PrefixStore where torch
    forwards them (torch 2.x), and its bad input refused with nothing written."""
    coord, credential = secured
    s = store(coord, credential, timeout=datetime.timedelta(seconds=20))
    assert s.has_extended_api()
    s.append("log", b"ab")  # an absent key counts as empty
    s.append("log", "cd")
    assert s.get("log") == b"abcd"
    s.multi_set(["m1", "m2", "m3"], [b"one", "two", [116, 104, 114, 101, 101]])
    assert s.multi_get(["m3", "m1", "m2"]) == [b"three", b"one", b"two"]
    assert s.multi_get([]) == [] and s.num_keys() == 4
    if hasattr(dist.PrefixStore, "multi_get"):  # torch 2.x forwards these to a Python store
        prefixed = dist.PrefixStore("p", s)
        assert prefixed.has_extended_api()
        prefixed.append("x", b"1")
        prefixed.append("x", b"2")
        prefixed.multi_set(["y", "z"], ["Y", "Z"])
        assert prefixed.multi_get(["x", "y", "z"]) == [b"12", b"Y", b"Z"]
        assert s.get("p/x") == b"12"
    held = s.num_keys()

    # Bad input: refused, and nothing written (multi_set checks every entry first).
    for call, error in (
        (lambda: s.append("", b"v"), InvalidArgumentError),
        (lambda: s.append("log", b"x" * (1024 * 1024 - 3)), InvalidArgumentError),  # past 1 MiB with "abcd"
        (lambda: s.multi_set(["n1", "n2"], [b"v"]), InvalidArgumentError),
        (lambda: s.multi_set(["n1", ""], [b"v", b"w"]), InvalidArgumentError),
        (lambda: s.multi_set(["n1", "n2"], [b"v", b"x" * (1024 * 1024 + 1)]), InvalidArgumentError),
        (lambda: s.multi_set(["n1", "n2"], [b"v", 7]), InvalidArgumentError),
        (lambda: s.multi_set(["n1", "n2"], [b"v", [256]]), InvalidArgumentError),
    ):
        with pytest.raises(error) as info:
            call()
        assert isinstance(info.value, ValueError), info.value
    assert s.get("log") == b"abcd" and s.num_keys() == held and not s.check(["n1"])
    # A multi_get of a key that never comes runs out with torch's store error.
    s.set_timeout(datetime.timedelta(milliseconds=300))
    with pytest.raises(timeout_error()):
        s.multi_get(["m1", "never"])


def test_waits_run_out_with_torchs_store_error(secured):
    coord, credential = secured
    s = store(coord, credential, timeout=datetime.timedelta(milliseconds=300))
    started = time.monotonic()
    with pytest.raises(timeout_error()):
        s.get("never")
    assert 0.3 <= time.monotonic() - started < 5
    with pytest.raises(timeout_error()):
        s.wait(["never"])
    started = time.monotonic()
    with pytest.raises(timeout_error()):
        s.wait(["never"], datetime.timedelta(milliseconds=200))
    assert 0.2 <= time.monotonic() - started < 5
    s.set_timeout(datetime.timedelta(seconds=20))
    assert s.timeout == datetime.timedelta(seconds=20)


def test_bad_input_is_refused_and_changes_nothing(secured):
    coord, credential = secured
    s = store(coord, credential)
    s.set("kept", b"v")
    for call in (
        lambda: s.set("", b"v"),
        lambda: s.set("k" * 1025, b"v"),
        lambda: s.set("big", b"x" * (1024 * 1024 + 1)),
        lambda: s.compare_set("kept", b"v", b"x" * (1024 * 1024 + 1)),
        lambda: s.add("", 1),
        lambda: s.check([]),
        lambda: store(coord, credential, scope="bad/scope").set("k", b"v"),
    ):
        with pytest.raises(InvalidArgumentError) as info:
            call()
        assert isinstance(info.value, ValueError) and "StoreOp" in str(info.value)
    assert s.num_keys() == 1 and s.get("kept") == b"v" and not s.check(["big"])


def test_a_wrong_credential_is_refused_and_changes_nothing(secured):
    coord, credential = secured
    s = store(coord, credential)
    s.set("k", b"mine")
    for token, job, code in (
        ("wrong", "kv", "unauthenticated"),
        (credential, "another-job", "permissiondenied"),
    ):
        intruder = store(coord, token, job=job, retry_budget=2.0)
        with pytest.raises(ControlError) as info:
            intruder.set("k", b"theirs")
        assert info.value.code == code, info.value
    assert s.get("k") == b"mine"


def test_gloo_rendezvous_through_the_store(secured, spawn):
    coord, credential = secured
    ranks = [
        spawn(f"gloo-{r}", "store_gloo.py", coord.endpoint, "kv", credential, str(r), "2", "gloo1") for r in range(2)
    ]
    for w in ranks:
        assert w.wait(timeout=120) == 0, w.output()
    for r, w in enumerate(ranks):
        assert f"ok rank={r} sum=3" in w.output(), w.output()


def test_ctrl_c_interrupts_a_waiting_get(secured, spawn):
    coord, credential = secured
    w = spawn("interrupt", "store_interrupt.py", coord.endpoint, "kv", credential)
    w.wait_for_line("^waiting", timeout=60)
    sent = time.monotonic()
    w.signal(signal.SIGINT)
    assert w.wait(timeout=30) == 0, w.output()
    assert "interrupted after" in w.output(), w.output()
    assert time.monotonic() - sent < 10, w.output()
