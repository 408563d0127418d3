"""``cohort.torch.managed``: torch's own backends, with cohort's membership.

A process group whose data plane is torch's gloo (CPU), and nccl for CUDA tensors with
``backend="nccl"`` (:mod:`cohort.torch.nccl`), and whose membership, failure detection and
root cause are cohort's::

    group = cohort.Group("job", coordinator)
    state = cohort.elastic.TorchState(group, model=net, optimizer=opt, step=0)

    def on_reform():                      # after every re-formation (a reset callback)
        cohort.torch.managed.init_process_group(state)     # gloo, for this generation's ranks
        trainer["ddp"] = DistributedDataParallel(net)

What it does, per generation that cohort forms:

- **Made through the coordinator's store.** :func:`init_process_group` makes torch's
  ``ProcessGroupGloo`` for the generation's ranks, rendezvousing through
  :class:`cohort.torch.Store` under a scope of the generation's own (``managed.g<N>.<k>``), so
  a group never reads an earlier generation's keys. ``new_group`` (and each dimension of a
  ``DeviceMesh``) makes a gloo group over its ranks in the same scope.
- **Failures reported through cohort.** A gloo call that fails (a peer closed its connection,
  gloo's own timeout) is reported to the coordinator
  (:meth:`cohort.Communicator.report_failure`), which asks each peer's process whether it runs
  and names the first that does not: the error raised (``PeerFailedError``, ...) carries the
  generation's root cause as the coordinator recorded it, the same on every rank, not gloo's
  "Connection closed by peer".
- **Revocation aborts in-flight work.** A watchdog thread per generation waits for the
  generation's revocation (:meth:`cohort.Communicator.wait_revoked`): any rank's report, a
  lease that lapsed (a stopped or vanished process), a leave. It then fails every call in
  flight at once with the revocation's ``RevokedError`` and aborts the gloo groups. gloo
  cannot cancel an operation blocked on a peer (torch 2.x's ``ProcessGroupGloo.abort()``
  returns without waking it, measured), so the abort shuts down the sockets the group opened
  (found when it was made; Linux): the blocked operations end at once, and the peers' with
  them.
- **A watchdog bound.** A call in flight longer than ``timeout`` (default: the group's
  ``late_rank_timeout``, so a rank that is merely late, saving a checkpoint say, is waited
  for) is reported as a timeout through cohort, so that every rank learns it. A rank that
  stops (SIGSTOP) or vanishes stops its heartbeats: its lease lapses (3 s by default) and the
  revocation names it. gloo's own timeout (the same ``timeout``) bounds each operation too.

Torch's conventions: the group is the default ``torch.distributed`` group, made with
``dist.init_process_group`` (backend name :data:`BACKEND`, CPU device), so
``DistributedDataParallel``, ``dist.*`` calls and, on torch 2.x, ``DeviceMesh`` and FSDP2 run
unmodified. A failed call's ``wait()`` raises the cohort error on torch 2.x; on torch 1.13
(torch's own Works there return from ``wait()``) the error comes from the future, so DDP's
backward raises it, and from the next call. :func:`cohort.collective_failure` finds the cohort
error behind torch's ``RuntimeError`` and :func:`cohort.elastic.run` recovers from it.
"""

from __future__ import annotations

import atexit
import datetime
import os
import socket
import stat
import threading
import time
import weakref
from typing import Any, Optional
from urllib.parse import urlparse

import torch
import torch.distributed as dist
from torch.futures import Future

from cohort._native import Communicator
from cohort.errors import CollectiveError, InvalidArgumentError, _handed_on
from cohort.torch import _BASES, PYTHON_BACKEND, TORCH2, _current, _Outcome, _work
from cohort.torch.store import Store

__all__ = ["BACKEND", "NCCL_BACKEND", "ManagedBackend", "init_process_group", "nccl_available", "current"]

BACKEND = "cohort_gloo"
"""The name of the ``torch.distributed`` backend (gloo's data plane, cohort's membership)."""

NCCL_BACKEND = "cohort_nccl"
"""The name of the backend for CUDA tensors under ``backend="nccl"`` (torch 2.x): nccl's data
plane, cohort's membership; the group's CPU backend stays :data:`BACKEND`."""

STORE_TIMEOUT = datetime.timedelta(seconds=60)
"""How long a rank waits for the others' gloo addresses in the store when a group is made."""

_C10D = torch._C._distributed_c10d


def _seconds(value: Any) -> float:
    if isinstance(value, datetime.timedelta):
        return value.total_seconds()
    return float(value)


# -- gloo's work in flight when the process exits ---------------------------------------------
# A gloo Work completes on gloo's own thread, and its future runs this module's callback there
# under the GIL (C++ wrappers that take the GIL again in their destructors). If that comes while
# the interpreter finalizes, CPython ends the thread (pthread_exit) inside one of those
# destructors, which cannot unwind: the process aborts ("terminate called without an active
# exception") after a clean end. That happens to a rank whose generation was revoked under a
# call it had just started: the watchdog fails the call at once and aborts gloo's sockets, the
# rank learns that the job ended and exits, and gloo's failed work lands during the exit. So
# the exit waits, bounded, for the works still in flight (atexit runs before finalization).

_EXIT_WAIT = 10.0
"""How long (seconds) the process's exit waits for gloo works still in flight (their own
thread's callbacks included) before the interpreter finalizes."""

_in_flight_lock = threading.Lock()
_in_flight: list[tuple[Any, Optional[threading.Thread]]] = []


def _settled(work: Any, waiter: Optional[threading.Thread]) -> bool:
    """Whether a tracked work is over: its waiting thread ended, or torch marked it completed
    (after its future's callbacks ran and were released: gloo completes the future first)."""
    if waiter is not None:
        return not waiter.is_alive()
    try:
        return bool(work.is_completed())
    except Exception:  # noqa: BLE001 - a work torch cannot answer for is not waited on
        return True


def _track(work: Any, waiter: Optional[threading.Thread] = None) -> None:
    """Tracks a gloo work (or the thread waiting for it) until it is over."""
    with _in_flight_lock:
        _in_flight[:] = [(w, t) for (w, t) in _in_flight if not _settled(w, t)]
        _in_flight.append((work, waiter))


def _drain_at_exit() -> None:
    """At exit: waits up to ``_EXIT_WAIT`` seconds in all for the tracked works to be over."""
    with _in_flight_lock:
        pending = [(w, t) for (w, t) in _in_flight if not _settled(w, t)]
        _in_flight.clear()
    deadline = time.monotonic() + _EXIT_WAIT
    for work, waiter in pending:
        left = deadline - time.monotonic()
        if left <= 0:
            return
        if waiter is not None:
            waiter.join(left)
            continue
        try:
            # Returns once gloo finished the work (its future, and the callbacks, first); a
            # failed work raises its error, which was reported when it failed.
            # (At least a millisecond: a zero timeout is torch's "no timeout".)
            work.wait(datetime.timedelta(seconds=max(left, 0.001)))
        except Exception:  # noqa: BLE001, S110 - failed or still running: nothing more to do
            pass


atexit.register(_drain_at_exit)


# -- the sockets a gloo group opened, to abort it ---------------------------------------------


def _socket_fds() -> dict[int, int]:
    """This process's socket descriptors and their inodes (Linux's /proc/self/fd)."""
    found: dict[int, int] = {}
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return found
    for name in names:
        try:
            fd = int(name)
            st = os.fstat(fd)
        except (OSError, ValueError):
            continue
        if stat.S_ISSOCK(st.st_mode):
            found[fd] = st.st_ino
    return found


class _Sockets:
    """The TCP connections a gloo group opened while it was made (its pairs'), to shut down
    when its generation is revoked: a blocked gloo operation then ends at once ("Connection
    closed"), on this rank and on the peers it was waiting with. Sockets to the coordinator
    (the store's calls) and gloo's listener are left alone."""

    def __init__(self, before: dict[int, int], after: dict[int, int], coordinator_ports: set[int]) -> None:
        self._owned: list[tuple[int, int]] = []
        for fd, inode in after.items():
            if before.get(fd) == inode:
                continue
            try:
                s = socket.socket(fileno=os.dup(fd))
            except OSError:
                continue
            try:
                if s.family not in (socket.AF_INET, socket.AF_INET6) or s.type != socket.SOCK_STREAM:
                    continue
                try:
                    peer = s.getpeername()
                except OSError:
                    # A listener: left open. Shutting gloo's listener down makes its accept
                    # loop throw, which ends the process (measured on torch 2.15).
                    continue
                if peer[1] in coordinator_ports:
                    continue
                self._owned.append((fd, inode))
            finally:
                s.close()

    def __len__(self) -> int:
        return len(self._owned)

    def shutdown(self) -> int:
        """Shuts down every socket still open under its descriptor; returns how many."""
        done = 0
        for fd, inode in self._owned:
            try:
                if os.fstat(fd).st_ino != inode:
                    continue  # closed and the number reused meanwhile
                s = socket.socket(fileno=os.dup(fd))
            except OSError:
                continue
            try:
                s.shutdown(socket.SHUT_RDWR)
                done += 1
            except OSError:
                pass
            finally:
                s.close()
        self._owned.clear()
        return done


# -- the calls in flight ------------------------------------------------------------------------


class _Call:
    """One call in flight on the wrapped backend: its torch future (completed once), and when
    it started (for the watchdog's bound)."""

    __slots__ = ("name", "fut", "outcome", "result", "started", "_lock", "done", "poll")

    def __init__(self, name: str, result: Any) -> None:
        self.name = name
        self.fut: Future = Future()
        self.outcome = _Outcome()
        self.result = result
        self.started = time.monotonic()
        self._lock = threading.Lock()
        self.done = False
        # A device call (nccl) completes on the GPU, not on a host thread: the watchdog asks
        # its Work (``is_completed``) instead of waiting for a future.
        self.poll: Optional[Any] = None

    def finish(self, error: Optional[BaseException], value: Any = None) -> bool:
        """Completes the torch future (with ``error`` if given); False if it was already."""
        with self._lock:
            if self.done:
                return False
            self.done = True
        if error is not None:
            _handed_on(error)
            self.outcome.error = error
        self.fut.set_result(self.result if value is None else value)
        return True


class _Generation:
    """The managed groups of one generation: their calls in flight, the sockets to shut down,
    and the watchdog that waits for the generation's revocation."""

    def __init__(self, comm: Communicator, timeout: float) -> None:
        self.comm = comm
        self.timeout = timeout
        self.kind = "gloo"  # the data plane named in reports ("nccl" once a CUDA group is made)
        self.error: Optional[CollectiveError] = None
        self._lock = threading.Lock()
        self._calls: list[_Call] = []
        self._sockets: list[_Sockets] = []
        self._backends: list[weakref.ref] = []
        self._stopped = threading.Event()
        self._reporting = False
        self._thread = threading.Thread(
            target=self._watch, name=f"cohort-managed-watchdog-g{comm.generation}", daemon=True
        )
        self._thread.start()

    # The watchdog: the generation's revocation, and the bound on each call in flight.
    def _watch(self) -> None:
        while not self._stopped.is_set():
            try:
                revoked = self.comm.wait_revoked(0.25)
            except Exception:  # noqa: BLE001 - the communicator was closed: this generation is over
                return
            if revoked is not None:
                self.fail(revoked)
                return
            with self._lock:
                polled = [c for c in self._calls if not c.done and c.poll is not None]
            for call in polled:
                try:
                    finished = call.poll()
                except Exception as e:  # noqa: BLE001 - the device work failed: reported through cohort
                    self.report(f"torch {self.kind}: {call.name}: {str(e).splitlines()[0] if str(e) else e!r}")
                    return
                if finished:
                    call.finish(None)
            with self._lock:
                overdue = [c for c in self._calls if not c.done and time.monotonic() - c.started > self.timeout]
            if overdue:
                self.report(
                    f"torch {self.kind}: {overdue[0].name} still in flight after {self.timeout:g} s "
                    "(the watchdog's bound)",
                    after=self.timeout,
                )
                return

    def stop(self) -> None:
        """Stops the watchdog (a later generation took over)."""
        self._stopped.set()

    def add_sockets(self, sockets: _Sockets) -> None:
        with self._lock:
            self._sockets.append(sockets)

    def add_backend(self, backend: Any) -> None:
        with self._lock:
            self._backends.append(weakref.ref(backend))

    def start(self, name: str, result: Any) -> Optional[_Call]:
        """A new call in flight, or None when the generation has already failed."""
        call = _Call(name, result)
        if self.error is None:
            # A call never starts on a revoked generation (the watchdog may not have looked yet).
            revoked = self.comm.wait_revoked(0)
            if revoked is not None:
                self.fail(revoked)
        with self._lock:
            if self.error is not None:
                return None
            self._calls = [c for c in self._calls if not c.done]
            self._calls.append(call)
        return call

    def report(self, reason: str, after: Optional[float] = None) -> CollectiveError:
        """Reports a failure seen on the wrapped backend through cohort (once per generation;
        the probe names a dead peer), then fails every call in flight with the root cause."""
        with self._lock:
            if self.error is not None:
                return self.error
            first = not self._reporting
            self._reporting = True
        if first:
            try:
                error = self.comm.report_failure(reason, after=after)
            except Exception as e:  # noqa: BLE001 - a closed communicator: the local error
                error = CollectiveError(f"{reason} (not reported: {e})", generation=self.comm.generation)
            self.fail(error)
        else:
            # Another thread is reporting: its answer (or the revocation) fails this call too.
            revoked = self.comm.wait_revoked(10.0)
            self.fail(revoked or CollectiveError(reason, generation=self.comm.generation))
        assert self.error is not None
        return self.error

    def fail(self, error: CollectiveError) -> None:
        """The generation failed: every call in flight fails with ``error`` now, and the gloo
        groups are aborted (their sockets shut down, so that blocked operations end)."""
        with self._lock:
            if self.error is None:
                self.error = error
            error = self.error
            calls, self._calls = self._calls, []
            sockets, self._sockets = self._sockets, []
            backends = [b for b in (ref() for ref in self._backends) if b is not None]
        self._stopped.set()
        for call in calls:
            call.finish(error)
        for backend in backends:
            backend._abort_inner()
        for s in sockets:
            s.shutdown()


_generation: Optional[_Generation] = None
_source: Any = None
_timeout: float = 1800.0
_store: Optional[Store] = None
_inits: dict[int, int] = {}


def _coordinator_ports(coordinator: Any) -> set[int]:
    endpoints = coordinator.split(",") if isinstance(coordinator, str) else list(coordinator)
    ports = set()
    for e in endpoints:
        url = urlparse(e.strip() if "://" in e else f"http://{e.strip()}")
        if url.port:
            ports.add(url.port)
    return ports


class ManagedBackend(*_BASES):  # type: ignore[misc]
    """torch's ``ProcessGroupGloo`` for one generation (or a group of its ranks), behind a
    backend that reports its failures through cohort and fails its calls with the generation's
    root cause (see the module's docs). Made by :func:`init_process_group` (and by torch's
    ``new_group``); each method keeps torch's name and forwards to gloo's."""

    def __init__(self, store: Any, rank: int, size: int, timeout: Any, kind: str = "gloo") -> None:
        super().__init__(rank, size)
        generation = _generation
        if generation is None or _source is None:
            raise RuntimeError("use cohort.torch.managed.init_process_group(state) to start the managed backend")
        comm = _current(_source)
        if comm is not generation.comm:
            raise InvalidArgumentError(
                "the managed process group belongs to an earlier generation: call "
                "cohort.torch.managed.init_process_group(state) again after a re-formation"
            )
        self._gen = generation
        self.kind = kind
        self.aborted = False  # whether the wrapped backend's abort() ran (and returned)
        self.abort_error: Optional[BaseException] = None  # what an abort() raised, if one did
        seconds = generation.timeout
        # The wrapped backends by device type: gloo for CPU tensors, nccl for CUDA ones. Where
        # torch makes a backend per device (PYTHON_BACKEND) this one holds one of them; where
        # it takes one process group for all devices (torch 2.11), the nccl group holds both.
        self._inners: dict[str, Any] = {}
        self._nccl: Any = None
        both = kind == "nccl" and not PYTHON_BACKEND
        if kind == "nccl":
            from cohort.torch import nccl

            self._nccl = nccl.create(dist.PrefixStore("nccl/", store) if both else store, rank, size, seconds)
            self._inners["cuda"] = self._nccl
            generation.kind = "nccl"
        if kind == "gloo" or both:
            config = _source.group.config
            before = _socket_fds()
            gloo_store = dist.PrefixStore("gloo/", store) if both else store
            self._inners["cpu"] = dist.ProcessGroupGloo(gloo_store, rank, size, datetime.timedelta(seconds=seconds))
            sockets = _Sockets(before, _socket_fds(), _coordinator_ports(config.coordinator))
            generation.add_sockets(sockets)
        self._inner = self._nccl if self._nccl is not None else self._inners["cpu"]
        generation.add_backend(self)

    def getBackendName(self) -> str:  # noqa: N802 - torch's name
        return NCCL_BACKEND if self.kind == "nccl" else BACKEND

    def _get_backend_name(self) -> str:
        return self.getBackendName()

    @property
    def inner(self) -> Any:
        """The wrapped ``ProcessGroupGloo`` (or ``ProcessGroupNCCL``)."""
        return self._inner

    def _abort_inner(self) -> None:
        for inner in self._inners.values():
            abort = getattr(inner, "abort", None)
            if abort is not None:
                try:
                    abort()
                    self.aborted = self.aborted or inner is self._inner
                except Exception as e:  # noqa: BLE001 - best effort: the sockets are shut down next
                    self.abort_error = e

    def _inner_for(self, tensors: Any) -> Any:
        """The wrapped backend for a call on ``tensors`` (nested lists): by the first tensor's
        device type; the main one when there is no tensor (a barrier) or no backend for it."""
        stack = [tensors]
        while stack:
            item = stack.pop(0)
            if isinstance(item, torch.Tensor):
                return self._inners.get(item.device.type, self._inner)
            if isinstance(item, (list, tuple)):
                stack.extend(item)
        return self._inner

    @property
    def supports_splitting(self) -> bool:
        return False

    @property
    def supports_coalescing(self) -> bool:
        return False

    @property
    def supports_time_estimate(self) -> bool:
        return False

    @property
    def supports_shrinking(self) -> bool:
        return False

    @property
    def supports_window(self) -> bool:
        return False

    @property
    def supports_reconfigure(self) -> bool:
        return False

    def _run(self, name: str, start: Any, result: Any, route: Any = None) -> Any:
        """Starts ``start(inner)`` (a call on the wrapped backend for the tensors of ``route``,
        default ``result``: :meth:`_inner_for`) and returns a torch Work that completes with
        it, or fails with the generation's root cause."""
        gen = self._gen
        call = gen.start(name, result)
        if call is None:
            assert gen.error is not None
            # Raised inside torch's C++ (DDP's autograd hook), it comes out as a RuntimeError
            # quoting it: recorded, so that cohort.collective_failure finds it there.
            _handed_on(gen.error)
            raise gen.error
        inner = self._inner_for(result if route is None else route)
        on_device = inner is self._nccl
        try:
            work = start(inner)
        except BaseException as e:
            call.finish(None)  # nothing in flight; the argument error is gloo's own
            if on_device and gen.error is not None:
                raise gen.error from e  # an aborted communicator: the root cause instead
            raise
        if on_device:
            from cohort.torch import nccl

            if work is None:
                # A synchronous call (async_op=False): torch 2.11's nccl runs it on the caller's
                # stream and gives no Work (torch then waits for none). The watchdog bounds it
                # by an event recorded behind it on that stream.
                call.poll = nccl.stream_marker().query
                return None
            call.poll = work.is_completed
            return nccl.DeviceWork(work, call, gen)

        def failed(e: BaseException) -> None:
            if not call.done:
                reason = f"torch gloo: {name}: {str(e).splitlines()[0] if str(e) else type(e).__name__}"
                threading.Thread(target=gen.report, args=(reason,), daemon=True).start()

        try:
            gloo_future = work.get_future()
        except RuntimeError:
            # Some of gloo's Works have no future ("Work::getFuture not implemented": torch
            # 2.15's reduce_scatter_tensor, which FSDP2 calls each step): a thread waits for it.
            def wait() -> None:
                try:
                    work.wait()
                except Exception as e:  # noqa: BLE001 - reported through cohort
                    failed(e)
                    return
                call.finish(None, result)

            waiter = threading.Thread(target=wait, name=f"cohort-managed-{name}", daemon=True)
            waiter.start()
            _track(work, waiter)
            return _work(call.fut, call.outcome)

        def done(f: Future) -> None:
            try:
                value = f.value()
            except Exception as e:  # noqa: BLE001 - reported through cohort, off gloo's thread
                failed(e)
                return
            call.finish(None, result if result is not None else value)

        gloo_future.add_done_callback(done)
        _track(work)
        return _work(call.fut, call.outcome)

    # -- the collectives (torch's names; gloo does the work) --------------------------------
    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        opts = opts if opts is not None else dist.AllreduceOptions()
        return self._run("allreduce", lambda inner: inner.allreduce(tensors, opts), tensors)

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        opts = opts if opts is not None else dist.AllreduceCoalescedOptions()
        return self._run("allreduce_coalesced", lambda inner: inner.allreduce_coalesced(tensors, opts), tensors)

    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        opts = opts if opts is not None else dist.BroadcastOptions()
        return self._run("broadcast", lambda inner: inner.broadcast(tensors, opts), tensors)

    def allgather(self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None) -> Any:
        opts = opts if opts is not None else dist.AllgatherOptions()
        return self._run("allgather", lambda inner: inner.allgather(outputs, inputs, opts), outputs)

    def _allgather_base(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> Any:
        opts = opts if opts is not None else dist.AllgatherOptions()
        return self._run("allgather_into_tensor", lambda inner: inner._allgather_base(output, input, opts), [output])

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> Any:
        return self._allgather_base(output, input, opts)

    def allgather_into_tensor_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> Any:
        opts = opts if opts is not None else dist.AllgatherOptions()
        return self._run(
            "allgather_into_tensor_coalesced",
            lambda inner: _coalesced(inner, "all_gather_single_coalesced", "_allgather_base", outputs, inputs, opts),
            outputs,
        )

    def all_gather_single_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> Any:
        return self.allgather_into_tensor_coalesced(outputs, inputs, opts)

    def _reduce_scatter_base(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> Any:
        opts = opts if opts is not None else dist.ReduceScatterOptions()
        return self._run(
            "reduce_scatter_tensor", lambda inner: inner._reduce_scatter_base(output, input, opts), [output]
        )

    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> Any:
        return self._reduce_scatter_base(output, input, opts)

    def reduce_scatter_tensor_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> Any:
        opts = opts if opts is not None else dist.ReduceScatterOptions()
        return self._run(
            "reduce_scatter_tensor_coalesced",
            lambda inner: _coalesced(
                inner, "reduce_scatter_single_coalesced", "_reduce_scatter_base", outputs, inputs, opts
            ),
            outputs,
        )

    def reduce_scatter_single_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> Any:
        return self.reduce_scatter_tensor_coalesced(outputs, inputs, opts)

    def reduce_scatter(self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]], opts: Any = None) -> Any:
        opts = opts if opts is not None else dist.ReduceScatterOptions()
        return self._run("reduce_scatter", lambda inner: inner.reduce_scatter(outputs, inputs, opts), outputs)

    def reduce(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        opts = opts if opts is not None else dist.ReduceOptions()
        return self._run("reduce", lambda inner: inner.reduce(tensors, opts), tensors)

    def gather(self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None) -> Any:
        opts = opts if opts is not None else dist.GatherOptions()
        return self._run("gather", lambda inner: inner.gather(outputs, inputs, opts), outputs, (inputs, outputs))

    def scatter(self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]], opts: Any = None) -> Any:
        opts = opts if opts is not None else dist.ScatterOptions()
        return self._run("scatter", lambda inner: inner.scatter(outputs, inputs, opts), outputs, (outputs, inputs))

    def alltoall_base(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_splits: list[int],
        input_splits: list[int],
        opts: Any = None,
    ) -> Any:
        opts = opts if opts is not None else dist.AllToAllOptions()
        return self._run(
            "alltoall",
            lambda inner: inner.alltoall_base(output, input, output_splits, input_splits, opts),
            [output],
        )

    def all_to_all_single(self, *args: Any) -> Any:
        return self.alltoall_base(*args)

    def alltoall(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None) -> Any:
        opts = opts if opts is not None else dist.AllToAllOptions()
        return self._run("alltoall", lambda inner: inner.alltoall(outputs, inputs, opts), outputs)

    def barrier(self, opts: Any = None) -> Any:
        opts = opts if opts is not None else dist.BarrierOptions()
        return self._run("barrier", lambda inner: inner.barrier(opts), [])

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int = 0) -> Any:
        return self._run("send", lambda inner: inner.send(tensors, dst, tag), tensors)

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int = 0) -> Any:
        return self._run("recv", lambda inner: inner.recv(tensors, src, tag), tensors)

    def monitored_barrier(self, opts: Any = None, wait_all_ranks: bool = False) -> Any:
        raise RuntimeError(
            "cohort managed backend: monitored_barrier is not supported; use barrier(), whose failure names "
            "the rank that failed first"
        )


class _Several:
    """The Works of a coalesced call that the wrapped backend runs as one call per tensor: its
    future completes with the outputs once every one has, or fails with the first error."""

    def __init__(self, works: list[Any], outputs: list[torch.Tensor]) -> None:
        self._works = works
        self._outputs = outputs

    def get_future(self) -> Future:
        def outcome(done: Future) -> Any:
            for each in done.value():
                each.value()  # raises a failed call's error
            return self._outputs

        return torch.futures.collect_all([w.get_future() for w in self._works]).then(outcome)

    def wait(self) -> bool:
        for w in self._works:
            w.wait()
        return True


def _coalesced(
    inner: Any, name: str, one: str, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any
) -> Any:
    """``inner.<name>(outputs, inputs, opts)`` (gloo's Python name for the coalesced call), or,
    where this torch's gloo has none (torch 2.11), ``inner.<one>`` per pair, in order."""
    call = getattr(inner, name, None)
    if call is not None:
        return call(outputs, inputs, opts)
    return _Several([getattr(inner, one)(o, i, opts) for o, i in zip(outputs, inputs)], outputs)


def _create(store: Any, rank: int, size: int, timeout: Any) -> ManagedBackend:
    return ManagedBackend(store, rank, size, timeout)


def _create_nccl(store: Any, rank: int, size: int, timeout: Any) -> ManagedBackend:
    return ManagedBackend(store, rank, size, timeout, kind="nccl")


_registered = False


def _register() -> None:
    global _registered
    if _registered:
        return
    if TORCH2:
        dist.Backend.register_backend(BACKEND, _create, devices=["cpu"])
        # One backend per device inside torch's group where torch makes them (PYTHON_BACKEND);
        # else the nccl group is the process group for both devices (gloo inside for CPU).
        nccl_devices = ["cuda"] if PYTHON_BACKEND else ["cpu", "cuda"]
        dist.Backend.register_backend(NCCL_BACKEND, _create_nccl, devices=nccl_devices)
    else:
        dist.Backend.register_backend(BACKEND, _create)
    _registered = True


def init_process_group(source: Any, backend: str = "gloo", *, timeout: Optional[float] = None) -> Any:
    """Makes torch's ``backend`` (``"gloo"``, or ``"nccl"`` on a CUDA machine under torch 2.x:
    nccl for CUDA tensors and gloo for CPU ones, :mod:`cohort.torch.nccl`) for the current generation of ``source`` (an
    elastic state: :class:`cohort.elastic.State`, whose ``group`` and ``comm`` it uses; or any
    object with those two, a :class:`cohort.Group` and its current communicator, as
    :mod:`cohort.hsdp` and examples/pytorch/fsdp2.py pass) the default ``torch.distributed``
    group, replacing any earlier one, and returns it.

    Every rank of the generation calls it (it rendezvouses through the coordinator's store, in
    a scope of the generation's own). ``timeout`` (seconds) bounds each call in flight (the
    watchdog's bound, and gloo's own timeout); default: the group's ``late_rank_timeout``
    (30 minutes), so a late rank is waited for as on the cohort backend, while a dead or
    stopped one is caught by cohort (its report, or its lease) at once. Call it again after
    every re-formation (a reset callback), and wrap the model in a new DDP.
    """
    global _generation, _source, _timeout, _store
    if backend == "nccl":
        from cohort.torch import nccl

        nccl.check_available(TORCH2)
    elif backend != "gloo":
        raise InvalidArgumentError(f'cohort.torch.managed: backend {backend!r} is not supported ("gloo", "nccl")')
    group = getattr(source, "group", None)
    if group is None or isinstance(source, Communicator):
        raise InvalidArgumentError(
            "cohort.torch.managed.init_process_group needs the elastic state (cohort.elastic.State), whose group "
            "names the job's store and whose communicator the generation"
        )
    comm = _current(source)
    config = group.config
    if timeout is None:
        timeout = _seconds(getattr(config, "late_rank_timeout", 1800.0))
    if not (isinstance(timeout, (int, float)) and 0 < timeout < float("inf")):
        raise InvalidArgumentError(
            f"cohort.torch.managed: timeout must be a positive number of seconds, not {timeout!r}"
        )
    _register()
    if dist.is_initialized():
        dist.destroy_process_group()
    if _generation is not None and _generation.comm is not comm:
        _generation.stop()
        _generation = None
    if _generation is None:
        _generation = _Generation(comm, float(timeout))
    _generation.timeout = float(timeout)
    _source = source
    _timeout = float(timeout)
    # A scope of the generation's own, and of this init within it: a group never reads the
    # keys of an earlier generation's (or an earlier init's) gloo rendezvous.
    k = _inits.get(comm.generation, 0)
    _inits.clear()
    _inits[comm.generation] = k + 1
    store = Store.from_config(config, scope=f"managed.g{comm.generation}.{k}", timeout=STORE_TIMEOUT)
    # Kept alive here: torch holds only the C++ half of a Store subclass, and a group made
    # later from it (new_group, a DeviceMesh dimension) would find its Python methods gone
    # ("Not implemented") once this object was collected.
    previous, _store = _store, store
    if backend == "nccl":
        from cohort.torch import nccl

        nccl.prepare_environment()
    dist.init_process_group(
        BACKEND if backend == "gloo" else f"cpu:{BACKEND},cuda:{NCCL_BACKEND}" if PYTHON_BACKEND else NCCL_BACKEND,
        store=store,
        rank=comm.rank,
        world_size=comm.size,
        timeout=datetime.timedelta(seconds=float(timeout)),
    )
    if previous is not None:
        # The earlier group's rendezvous keys, this rank's share: deleted off the caller's path
        # (a job that re-forms for months would otherwise keep every generation's keys).
        threading.Thread(target=_sweep, args=(previous,), name="cohort-managed-sweep", daemon=True).start()
    from torch.distributed import distributed_c10d as c10d

    return c10d._get_default_group()


def _sweep(store: Store) -> None:
    try:
        store.delete_written()
    except Exception:  # noqa: BLE001, S110 - a coordinator out of reach: the job's end sweeps them
        pass


def nccl_available() -> bool:
    """Whether ``backend="nccl"`` can run here: torch 2.x with nccl, and a CUDA device."""
    from cohort.torch import nccl

    return TORCH2 and nccl.available()


def current() -> Optional[CollectiveError]:
    """The current generation's failure, if the managed groups have seen one (else None)."""
    return None if _generation is None else _generation.error
