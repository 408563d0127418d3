"""``cohort.torch.Store``: a ``torch.distributed.Store`` kept by the cohort coordinator.

torch's own backends (gloo, nccl) rendezvous through a c10d ``Store``: usually a ``TCPStore``
served by rank 0, so the job's rendezvous dies with that process. This store lives in the
coordinator instead, in etcd when the coordinator runs on etcd, so it outlives any worker and
any coordinator replica::

    store = cohort.torch.Store("job-7", "http://coord-a:7470,http://coord-b:7470", token=token, scope="g3")
    dist.init_process_group("nccl", store=store, rank=rank, world_size=world)

It implements torch's ``Store`` (set, get, add, compare_set, check, delete_key, num_keys,
wait) and torch 2.x's extended API (append, multi_get, multi_set; ``has_extended_api`` is
True). Keys are the job's, under ``scope`` (a namespace such as the generation, ``[A-Za-z0-9._-]``);
they are authenticated with the job's credential and deleted when the job ends. Bounds (the
coordinator's): keys of 1 to 1,024 bytes, values up to 1 MiB, 65,536 keys per job; a call past
them raises :class:`cohort.errors.InvalidArgumentError` (a ``ValueError``) and changes nothing.
"""

from __future__ import annotations

import datetime
import threading
from typing import Any, Optional, Sequence, Union

import torch

from cohort._native import KeyValueStore
from cohort.errors import InvalidArgumentError

__all__ = ["Store", "DEFAULT_TIMEOUT", "WRITTEN_KEPT"]

DEFAULT_TIMEOUT = datetime.timedelta(minutes=5)
"""How long ``get`` and ``wait`` wait for their keys unless told otherwise (torch's default)."""

WRITTEN_KEPT = 10_000
"""How many written keys a :class:`Store` remembers for :meth:`Store.delete_written`."""

_C10D = torch._C._distributed_c10d


def _timeout_error(message: str) -> Exception:
    """torch's store timeout error where torch has one (``DistStoreError``, torch 2.x), else
    a ``RuntimeError`` as torch 1.13's stores raise; either way also a ``TimeoutError`` where
    torch's class allows it."""
    error: Any = getattr(torch.distributed, "DistStoreError", RuntimeError)
    return error(message)


MAX_KEY_LEN = 1024
"""The longest key, in bytes (the coordinator's bound)."""

MAX_VALUE_LEN = 1 << 20
"""The largest value, in bytes (the coordinator's bound: 1 MiB)."""


def _check_entry(key: Any, value: Any) -> None:
    """A key and value within the coordinator's bounds, checked before a multi-key write
    starts, so that a bad entry refuses the whole call rather than what follows it."""
    if not isinstance(key, str):
        raise InvalidArgumentError(f"multi_set: a key must be a str, not {type(key).__name__}")
    if not 1 <= len(key.encode()) <= MAX_KEY_LEN or "\0" in key:
        raise InvalidArgumentError(
            f"multi_set: key {key[:40]!r}{'...' if len(key) > 40 else ''} must be 1 to {MAX_KEY_LEN} bytes, no NUL"
        )
    if isinstance(value, str):
        value = value.encode()
    elif isinstance(value, (list, tuple, memoryview)):
        try:
            value = bytes(value)  # a list of byte values, as torch's own stores take
        except (TypeError, ValueError):
            raise InvalidArgumentError(f"multi_set: value of key {key!r} is not a sequence of bytes") from None
    elif not isinstance(value, (bytes, bytearray)):
        raise InvalidArgumentError(f"multi_set: value of key {key!r} must be bytes or str, not {type(value).__name__}")
    if len(value) > MAX_VALUE_LEN:
        raise InvalidArgumentError(
            f"multi_set: value of key {key!r} is {len(value)} bytes (at most 1 MiB, {MAX_VALUE_LEN} bytes)"
        )


def _seconds(timeout: Any) -> float:
    if isinstance(timeout, datetime.timedelta):
        return max(timeout.total_seconds(), 0.0)
    return max(float(timeout), 0.0)


class Store(_C10D.Store):  # type: ignore[misc]
    """A ``torch.distributed.Store`` on the cohort coordinator (see the module's docs).

    ``job`` and ``coordinator`` (one endpoint, a comma-separated list, or a sequence: any
    replica serves) name the job's store; ``token`` is the job's credential (or the operator
    secret); ``scope`` keeps this store's keys apart from other scopes of the job (use the
    generation, e.g. ``f"g{generation}"``, so that a re-formed group never reads the keys of
    the one before). ``timeout`` bounds ``get`` and ``wait`` (``set_timeout`` changes it);
    ``request_timeout`` and ``retry_budget`` bound each call to the coordinator and its retries
    across the endpoints, as in :class:`cohort.GroupConfig`.

    Every call releases the GIL while it waits; Ctrl-C interrupts a waiting ``get`` or
    ``wait`` on the main thread. A coordinator that cannot be reached within the retry budget
    raises :class:`cohort.errors.ControlError`.
    """

    def __init__(
        self,
        job: str,
        coordinator: Union[str, Sequence[str]],
        *,
        token: Optional[str] = None,
        scope: str = "",
        timeout: datetime.timedelta = DEFAULT_TIMEOUT,
        tls_ca: Optional[str] = None,
        request_timeout: float = 5.0,
        retry_budget: float = 30.0,
    ) -> None:
        super().__init__()
        self._kv = KeyValueStore(
            coordinator,
            job,
            token=token,
            scope=scope,
            tls_ca=tls_ca,
            request_timeout=request_timeout,
            retry_budget=retry_budget,
        )
        self.set_timeout(timeout)
        # The keys this object wrote, for delete_written (at most WRITTEN_KEPT of them).
        self._written: set[str] = set()
        self._written_lock = threading.Lock()

    def _wrote(self, key: str) -> None:
        with self._written_lock:
            if len(self._written) < WRITTEN_KEPT:
                self._written.add(key)

    def delete_written(self) -> int:
        """Deletes every key this object wrote (``set``, ``add``, ``append``, ``compare_set``,
        ``multi_set``; the first :data:`WRITTEN_KEPT`) and forgets them; returns how many still
        existed. :mod:`cohort.torch.managed` calls it on a generation's store once the next
        group is made, so that a job that re-forms for months does not keep every generation's
        rendezvous keys until it ends."""
        with self._written_lock:
            keys, self._written = sorted(self._written), set()
        return sum(1 for key in keys if self._kv.delete_key(key))

    @classmethod
    def from_config(cls, config: Any, scope: str = "", timeout: datetime.timedelta = DEFAULT_TIMEOUT) -> Store:
        """The store of the job a :class:`cohort.GroupConfig` names, with its coordinator,
        credential, CA and timeouts."""
        return cls(
            config.job,
            config.coordinator,
            token=config.token,
            scope=scope,
            timeout=timeout,
            tls_ca=config.tls_ca,
            request_timeout=config.request_timeout,
            retry_budget=config.retry_budget,
        )

    @property
    def job(self) -> str:
        """The job."""
        return self._kv.job

    @property
    def scope(self) -> str:
        """The scope."""
        return self._kv.scope

    def set(self, key: str, value: Union[bytes, str]) -> None:
        """Writes ``value`` (bytes, or a str as its UTF-8) under ``key``."""
        self._kv.set(key, value)
        self._wrote(key)

    def get(self, key: str) -> bytes:
        """The value of ``key``, waiting for it up to the store's timeout (then torch's store
        timeout error)."""
        value = self._kv.get(key, _seconds(self.timeout))
        if value is None:
            raise _timeout_error(f"cohort store: key {key!r} not set within {self.timeout} (job {self.job})")
        return value

    def add(self, key: str, value: int) -> int:
        """Adds ``value`` to the integer under ``key`` (absent: 0); returns the sum."""
        total = self._kv.add(key, int(value))
        self._wrote(key)
        return total

    def append(self, key: str, value: Union[bytes, str]) -> None:
        """Appends ``value`` to the bytes under ``key`` (an absent key counts as empty), in one
        compare-and-swap at the coordinator: concurrent appends are each applied once. A result
        past the value bound (1 MiB) is refused and nothing is written."""
        self._kv.append(key, value)
        self._wrote(key)

    def multi_get(self, keys: list[str]) -> list[bytes]:
        """The values of ``keys``, in order, waiting for all of them up to the store's timeout
        (then torch's store timeout error), as ``TCPStore.multi_get``. One wait, then one read
        per key (not a snapshot: a key rewritten meanwhile is read as it is then)."""
        keys = list(keys)
        if not keys:
            return []
        self.wait(keys)
        values = []
        for key in keys:
            value = self._kv.get(key, 0.0)
            if value is None:
                raise _timeout_error(f"cohort store: key {key!r} was deleted while multi_get read it (job {self.job})")
            values.append(value)
        return values

    def multi_set(self, keys: list[str], values: list[Union[bytes, str]]) -> None:
        """Writes ``values[i]`` under ``keys[i]``, in order: one call per key, so not atomic as a
        whole (a reader may see the first keys before the last). ``keys`` and ``values`` of
        different lengths raise :class:`cohort.errors.InvalidArgumentError` before anything is
        written, as does a key or value out of bounds (checked here first: nothing written)."""
        keys, values = list(keys), list(values)
        if len(keys) != len(values):
            raise InvalidArgumentError(f"multi_set: {len(keys)} keys but {len(values)} values")
        for key, value in zip(keys, values):
            _check_entry(key, value)
        for key, value in zip(keys, values):
            self._kv.set(key, value)
            self._wrote(key)

    def has_extended_api(self) -> bool:
        """True: ``append``, ``multi_get`` and ``multi_set`` are implemented (torch's
        ``PrefixStore`` forwards them to this store). ``queue_push``, ``queue_pop`` and
        ``queue_len`` are not: torch 2.x does not forward them to a Python store."""
        return True

    def compare_set(self, key: str, expected: Union[bytes, str], desired: Union[bytes, str]) -> bytes:
        """Writes ``desired`` if ``key`` holds ``expected`` (or is absent and ``expected`` is
        empty); returns the value stored now (``expected`` for an absent key and a non-empty
        ``expected``), as torch's ``TCPStore``."""
        stored = self._kv.compare_set(key, expected, desired)
        self._wrote(key)
        return stored

    def check(self, keys: list[str]) -> bool:
        """Whether every key exists now."""
        return self._kv.check(list(keys))

    def delete_key(self, key: str) -> bool:
        """Deletes ``key``; returns whether it existed."""
        return self._kv.delete_key(key)

    def num_keys(self) -> int:
        """How many keys the scope holds."""
        return self._kv.num_keys()

    def wait(self, keys: list[str], timeout: Optional[datetime.timedelta] = None) -> None:
        """Waits until every key exists, up to ``timeout`` (default: the store's), then raises
        torch's store timeout error."""
        limit = self.timeout if timeout is None else timeout
        if not self._kv.wait(list(keys), _seconds(limit)):
            raise _timeout_error(f"cohort store: keys {list(keys)!r} not all set within {limit} (job {self.job})")

    def __repr__(self) -> str:
        return f"cohort.torch.Store(job={self.job!r}, scope={self.scope!r})"
