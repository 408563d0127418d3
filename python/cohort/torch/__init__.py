"""PyTorch on cohort: bucketed gradient averaging, and a ``torch.distributed`` backend.

Two ways in, both over the current generation's :class:`cohort.Communicator` (so both follow
re-formations):

1. :class:`GradientAverager`: averages a model's gradients in buckets (one fused buffer and one
   collective per bucket, not one per parameter), started from autograd hooks as soon as a
   bucket's gradients are final, so communication overlaps the rest of backward (the
   collectives run on the communicator's own thread while autograd continues).
   ``synchronize()`` waits for them before ``optimizer.step()``.

2. The ``"cohort"`` backend of ``torch.distributed`` (:func:`init_process_group`), so that
   ``torch.nn.parallel.DistributedDataParallel`` runs unmodified. The process group forwards
   every call to the *current* communicator of the elastic state or group it was made from:
   when a re-formation keeps the world size, the communicator beneath DDP is swapped with
   nothing to do; when the size changes, call :func:`init_process_group` again (a reset
   callback) and wrap the model in a new DDP (DDP caches the world size it divides by).

The backend (:class:`CohortBackend`) is registered for the CPU device, and for CUDA where
there is one. On torch 2.x with :data:`PYTHON_BACKEND` it is a
``c10d.Backend`` inside torch's own ``ProcessGroup`` (group names, ``DeviceMesh``, DTensor and
FSDP2's ``fully_shard`` work); on torch 1.13 it is the ``ProcessGroup``. Supported:
``all_reduce`` (SUM, PRODUCT, MIN, MAX, AVG), ``all_reduce_coalesced``, ``broadcast``,
``all_gather_into_tensor`` and ``reduce_scatter_tensor`` (alone or coalesced), ``all_gather``,
``reduce_scatter``, ``all_to_all_single`` (equal splits), ``all_to_all`` (equal sizes),
``gather``, ``scatter``, ``reduce``, ``barrier``, ``send``/``recv``/``isend``/``irecv`` and
``batch_isend_irecv`` (tag 0; a receive may be posted before its send, see :class:`_Lane`). The rest raises an
error naming the call: tags, uneven all-to-all, ``recv`` from any source,
``monitored_barrier``, sparse tensors, and on torch 1.13 ``new_group`` over a subset of ranks.
On torch 2.x, ``new_group`` and a ``DeviceMesh`` of several dimensions (HSDP) give subgroups of
the generation (:meth:`cohort.Communicator.subgroup`) over its links, each on a channel derived
from torch's group name (:func:`subgroup_channel`). CPU tensors, and CUDA tensors in
``all_reduce``, ``all_reduce_coalesced``, ``broadcast`` and ``all_gather`` (staged through
pinned host memory: :mod:`cohort.torch.cuda`), dtypes
float32/float64/float16/bfloat16/int32/int64/uint8. docs/python.md has the table of torch calls and cohort collectives.
3. :class:`Store` (``cohort.torch.store``): a ``torch.distributed.Store`` kept by the coordinator
   (in etcd when it runs on etcd), through which torch's own backends rendezvous:
   ``dist.init_process_group("nccl", store=cohort.torch.Store(job, coordinator, token=...),
   rank=r, world_size=n)``.

On torch 2.x the world group also takes torch's fault-tolerance hooks (``dist._reconfigure``):
after a re-formation through cohort that keeps the world's size and this rank, it binds the same
torch group to the new generation (:meth:`CohortBackend.reconfigure`).
"""

from __future__ import annotations

import atexit
import hashlib
import os
import queue
import threading
from typing import Any, Callable, Optional, Union

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import ProcessGroup, _create_work_from_future
from torch.futures import Future

from cohort._native import Communicator, Group, Work
from cohort.errors import InvalidArgumentError, _handed_on
from cohort.torch import cuda
from cohort.torch.store import Store

__all__ = [
    "GradientAverager",
    "CohortBackend",
    "CohortProcessGroup",
    "init_process_group",
    "Store",
    "BACKEND",
    "TORCH2",
    "PYTHON_BACKEND",
]

BACKEND = "cohort"
"""The name of the ``torch.distributed`` backend."""

Source = Union[Communicator, Any]
"""A communicator, or anything with a ``comm`` attribute (a :class:`cohort.elastic.State`)."""


_AVERAGER_ATTR = "_cohort_gradient_averager"
"""Where a model keeps its current :class:`GradientAverager`."""


def _current(source: Source) -> Communicator:
    comm = source if isinstance(source, Communicator) else getattr(source, "comm", None)
    if comm is None:
        raise RuntimeError("no current communicator: re-form first (cohort.elastic.run does)")
    return comm


def _own_member(comm: Communicator) -> Any:
    """This rank's own entry of ``comm.members`` (every view holds it, sparse or whole)."""
    for m in comm.members:
        if m.rank == comm.rank:
            return m
    raise RuntimeError(f"generation {comm.generation}: rank {comm.rank} is not among its own members")


class GradientAverager:
    """Averages the gradients of ``model`` over the ranks, in buckets, overlapped with backward.

    ``source`` is the communicator, or an elastic state whose ``comm`` is the current one.
    ``op`` is "avg" (the mean over ranks, as DDP) or "sum" (for a loss already scaled by the
    global batch). Buckets hold parameters in reverse registration order (about the order backward produces
    their gradients) up to ``bucket_bytes`` each; every rank launches them in the same order.
    After ``synchronize()`` each parameter's ``.grad`` is a view into its bucket, so the next
    backward accumulates in place and no copy is needed (``zero_grad()`` keeps the views;
    ``set_to_none=True`` only costs one copy per parameter).

    A model has at most one averager: building another one for the same model (in the function
    that :func:`cohort.elastic.run` calls again after a failure, say) first removes the earlier
    one's hooks, so that no bucket is ever launched twice.
    """

    def __init__(self, model: torch.nn.Module, source: Source, bucket_bytes: int = 4 << 20, op: str = "avg") -> None:
        if bucket_bytes <= 0:
            raise ValueError("bucket_bytes must be positive")
        if op not in ("avg", "sum"):
            raise ValueError("op must be 'avg' (mean over ranks) or 'sum' (the loss is already scaled)")
        previous = model.__dict__.get(_AVERAGER_ATTR)
        if previous is not None:
            previous.remove()
        self.source = source
        self.op = op
        params = [p for p in model.parameters() if p.requires_grad]
        for p in params:
            if p.device.type != "cpu":
                raise InvalidArgumentError(
                    f"GradientAverager: a parameter is on {p.device}; cohort averages CPU tensors"
                )
        self._buckets: list[_Bucket] = []
        current: list[torch.nn.Parameter] = []
        size = 0
        for p in reversed(params):
            if current and (size + p.numel() * p.element_size() > bucket_bytes or p.dtype != current[0].dtype):
                self._buckets.append(_Bucket(current))
                current, size = [], 0
            current.append(p)
            size += p.numel() * p.element_size()
        if current:
            self._buckets.append(_Bucket(current))
        self._where: dict[int, tuple[int, int]] = {}
        for b, bucket in enumerate(self._buckets):
            for k, p in enumerate(bucket.params):
                self._where[id(p)] = (b, k)
        self._next_launch = 0
        self._hooks = []
        for p in params:
            # The AccumulateGrad node of p: its post-hook runs once p.grad holds the gradient.
            accumulator = p.expand_as(p).grad_fn.next_functions[0][0]
            self._hooks.append((accumulator, accumulator.register_hook(self._hook_for(p))))
        # Not an nn.Module attribute (no state_dict entry): the model's plain __dict__.
        model.__dict__[_AVERAGER_ATTR] = self
        self._model = model

    def _hook_for(self, p: torch.nn.Parameter) -> Callable[..., None]:
        def hook(*_: Any) -> None:
            b, k = self._where[id(p)]
            bucket = self._buckets[b]
            if not bucket.ready[k]:
                bucket.ready[k] = True
                bucket.pending -= 1
            self._launch_ready()

        return hook

    def _launch_ready(self) -> None:
        while self._next_launch < len(self._buckets) and self._buckets[self._next_launch].pending == 0:
            self._buckets[self._next_launch].launch(_current(self.source), self.op)
            self._next_launch += 1

    def remove(self) -> None:
        """Removes the autograd hooks: the averager no longer launches anything (idempotent;
        a new averager for the same model calls it)."""
        for _accumulator, handle in self._hooks:
            handle.remove()
        self._hooks.clear()
        if self._model.__dict__.get(_AVERAGER_ATTR) is self:
            del self._model.__dict__[_AVERAGER_ATTR]

    @property
    def active(self) -> bool:
        """True until :meth:`remove` (or a newer averager for the same model) removed the hooks."""
        return bool(self._hooks)

    @property
    def buckets(self) -> int:
        """Number of buckets."""
        return len(self._buckets)

    def synchronize(self) -> None:
        """Launches any bucket still waiting (parameters without a gradient this step count as
        zero), waits for every bucket, and leaves the averages in the parameters' ``.grad``.
        Raises the collective's error (a :class:`cohort.CollectiveError`) on failure."""
        comm = _current(self.source)
        while self._next_launch < len(self._buckets):
            self._buckets[self._next_launch].launch(comm, self.op)
            self._next_launch += 1
        self._next_launch = 0
        first_error: Optional[BaseException] = None
        for bucket in self._buckets:
            try:
                bucket.finish()
            except BaseException as e:  # noqa: BLE001 - every bucket is waited for, the first error raised
                first_error = first_error or e
        if first_error is not None:
            raise first_error


class _Bucket:
    """Parameters whose gradients travel in one fused buffer."""

    def __init__(self, params: list[torch.nn.Parameter]) -> None:
        self.params = params
        self.flat = torch.zeros(sum(p.numel() for p in params), dtype=params[0].dtype)
        self.views = []
        offset = 0
        for p in params:
            self.views.append(self.flat[offset : offset + p.numel()].view_as(p))
            offset += p.numel()
        self.ready = [False] * len(params)
        self.pending = len(params)
        self.work: Optional[Work] = None

    def launch(self, comm: Communicator, op: str) -> None:
        with torch.no_grad():
            for p, view in zip(self.params, self.views):
                if p.grad is None:
                    view.zero_()
                elif p.grad.data_ptr() != view.data_ptr():
                    view.copy_(p.grad)
        self.work = comm.allreduce_async(self.flat, op)

    def finish(self) -> None:
        work, self.work = self.work, None
        self.ready = [False] * len(self.params)
        self.pending = len(self.params)
        if work is not None:
            work.wait()
        for p, view in zip(self.params, self.views):
            p.grad = view


_REDUCE_OPS = {
    dist.ReduceOp.SUM: "sum",
    dist.ReduceOp.PRODUCT: "prod",
    dist.ReduceOp.MIN: "min",
    dist.ReduceOp.MAX: "max",
}
if hasattr(dist.ReduceOp, "AVG"):
    _REDUCE_OPS[dist.ReduceOp.AVG] = "avg"


def _op_name(call: str, opts: Any) -> str:
    op = getattr(opts, "reduceOp", None) if opts is not None else None
    if op is None:
        return "sum"
    for key, name in _REDUCE_OPS.items():
        if op == key:
            return name
    raise RuntimeError(f"cohort backend: {call}: reduce op {op} is not supported (sum, product, min, max, avg)")


class _Outcome:
    """A collective's error, if it failed, for the torch ``Work`` that waits for it, and the
    cohort Works it waits for (which the waiting thread waits on too: see :class:`_FutureWork`)."""

    error: Optional[BaseException] = None
    works: "tuple[Work, ...]" = ()


#: How long the interpreter's exit waits for the completer to finish the Works it holds.
_EXIT_WAIT = 10.0


_Queued = tuple[list[Work], Future, _Outcome, Any, Optional[Callable[[], None]], "tuple[cuda.Staged, ...]"]
"""A call the completer holds: its Works, the future, the outcome, the result, what to do
after the Works, and its staged CUDA tensors."""


class _Completer:
    """Completes torch futures from cohort Works on one thread, in issue order."""

    def __init__(self) -> None:
        self._queue: "queue.Queue[Optional[_Queued]]" = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="cohort-torch-completer", daemon=True)
        self._thread.start()
        atexit.register(self._finish)

    def _finish(self) -> None:
        """At the interpreter's exit: lets the thread complete the futures of the Works it has
        (for at most ``_EXIT_WAIT`` seconds), then stops it. A daemon thread still inside
        torch's C++ (completing a future) when the interpreter finalizes is ended by
        ``pthread_exit``, whose unwinding through torch's frames aborts the whole process
        ("terminate called without an active exception"): seen after Ctrl-C in
        ``dist.all_reduce``, whose aborted Work the thread was still completing."""
        self._queue.put(None)
        self._thread.join(timeout=_EXIT_WAIT)

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            works, fut, outcome, result, then, staged = item
            error: Optional[BaseException] = None
            for work in works:  # every Work is waited for (its buffers stay alive until then)
                try:
                    work.wait()
                except BaseException as e:  # noqa: BLE001 - handed to the future's waiter
                    error = error or e
            for s in staged:  # CUDA tensors: each chunk copied back as its collective ends
                error = _finish_staged(s, error)
            if error is None and then is not None:
                try:
                    then()
                except BaseException as e:  # noqa: BLE001 - handed to the future's waiter
                    error = e
            # A Python future cannot fail where C++ sees it: its set_exception stores the
            # exception object as the *value*, which DDP's reducer read as the reduced tensors
            # (a segmentation fault on torch 2.x). So the future completes with the output, and
            # the future handed to torch is chained on it with a callback that raises the error:
            # a callback's error fails the chained future in C++ (DDP's backward raises it).
            if error is not None:
                _handed_on(error)
            outcome.error = error
            fut.set_result(result)

    def submit(
        self,
        works: list[Work],
        result: Any,
        then: Optional[Callable[[], None]] = None,
        staged: "tuple[cuda.Staged, ...]" = (),
    ) -> Any:
        """A torch ``Work`` that completes once every one of ``works`` (and every chunk of the
        ``staged`` CUDA tensors, copied back) has, after ``then``; it fails with their first
        error."""
        fut: Future = Future()
        outcome = _Outcome()
        outcome.works = tuple(works) + tuple(w for s in staged for w in s.works)
        self._queue.put((works, fut, outcome, result, then, staged))
        return _work(fut, outcome)


def _finish_staged(staged: "cuda.Staged", error: Optional[BaseException]) -> Optional[BaseException]:
    """Waits for a staged CUDA tensor's chunks, copying each back as it ends (while no error has
    been seen), and releases its pinned buffer; returns the first error."""
    try:
        for i, work in enumerate(staged.works):
            try:
                work.wait()
            except BaseException as e:  # noqa: BLE001 - handed to the future's waiter
                error = error or e
                continue
            if error is None:
                staged.chunk_done(i)
        if error is None:
            staged.finish()
    except BaseException as e:  # noqa: BLE001 - a CUDA error copying back: the call's error
        error = error or e
    finally:
        staged.release()
    return error


def _work(fut: Future, outcome: _Outcome, python_work: Optional[bool] = None) -> Any:
    """The torch ``Work`` of a collective whose output ``fut`` will hold (``outcome.error`` set
    first if it failed). ``python_work``: a :class:`_FutureWork`, whose ``wait()`` raises the
    error (the default on torch 2.x; point-to-point asks for it on 1.13 too, where no DDP
    needs the Work's future from C++)."""

    def value_or_error(done: Future) -> Any:
        if outcome.error is not None:
            raise outcome.error
        return done.value()

    chained = fut.then(value_or_error)
    if TORCH2 if python_work is None else python_work:
        return _FutureWork(fut, chained, outcome)
    return _create_work_from_future(chained)


class _FutureWork(torch._C._distributed_c10d.Work):  # type: ignore[misc]
    """torch 2.x: a ``Work`` whose ``wait()`` raises the collective's error. torch's own
    ``_create_work_from_future`` returns from ``wait()`` whether the future failed or not, so a
    failed ``dist.all_reduce`` returned as if it had succeeded, its output holding this rank's
    input, and the error came from the next call. ``get_future()`` (DDP's reducer) fails with
    it too. (torch 1.13 cannot override ``getFuture`` of a Python Work, which its DDP needs:
    there the backend uses torch's Work over the failing future, whose ``wait()`` returns.)"""

    def __init__(self, fut: Future, chained: Future, outcome: _Outcome) -> None:
        super().__init__()
        self._fut = fut
        self._chained = chained
        self._outcome = outcome

    def wait(self, timeout: Any = None) -> bool:
        # torch's Future.wait() blocks in C++ without looking for signals: Ctrl-C inside
        # dist.all_reduce then waited for the collective's own end (the no-progress deadline,
        # 10 s). So the calling thread first waits on the cohort Works themselves, whose wait
        # looks for signals every 50 ms on the main thread (KeyboardInterrupt, and SIGTERM's
        # GracefulLeave for a group without commit points) as the raw collectives do; their
        # errors are left to the completer, which fails the future with the first one.
        for work in self._outcome.works:
            try:
                work.wait()
            except Exception:  # noqa: BLE001, S110 - a collective error: raised below, from the outcome
                pass
        self._fut.wait()
        if self._outcome.error is not None:
            raise self._outcome.error  # the cohort error itself, not torch's RuntimeError
        return True

    def is_completed(self) -> bool:
        return self._fut.done()

    def get_future(self) -> Future:
        return self._chained


_completer: Optional[_Completer] = None


def _done(result: Any) -> Any:
    fut: Future = Future()
    fut.set_result(result)
    return _work(fut, _Outcome())


_C10D = torch._C._distributed_c10d
TORCH2 = hasattr(_C10D, "Backend")
"""True on torch 2.x: the process group is torch's own, with :class:`CohortBackend` registered
as its CPU backend (torch routes every collective to it); on torch 1.13 the backend *is* the
process group (1.13's ``ProcessGroup`` is subclassed)."""


def _python_backends() -> bool:
    """Whether this torch lets Python subclass c10d's ``Backend`` (it binds the constructor):
    torch 2.15 does, torch 2.11 does not ("No constructor defined!"). ``COHORT_TORCH_AS_PROCESS_GROUP=1``
    answers no anyway (the test command runs torch 2.15 so, to keep torch 2.11's path tested)."""
    if not TORCH2 or os.environ.get("COHORT_TORCH_AS_PROCESS_GROUP", "") not in ("", "0"):
        return False

    class _Probe(_C10D.Backend):  # type: ignore[misc, name-defined]
        pass

    try:
        _Probe(0, 1)
    except TypeError:
        return False
    return True


PYTHON_BACKEND = _python_backends()
"""True where :class:`CohortBackend` is a ``c10d.Backend`` inside torch's own ``ProcessGroup``
(torch 2.x releases that let Python subclass ``Backend``); else it is the ``ProcessGroup``
itself, as on torch 1.13: torch 2.x takes a process group from a backend's creator as it is
(torch 2.11: every call, DDP, ``new_group``, DeviceMesh, functional collectives and FSDP2/HSDP
run; ``COHORT_TORCH_AS_PROCESS_GROUP=1`` takes this form on any torch 2.x)."""

_Base: Any = _C10D.Backend if PYTHON_BACKEND else ProcessGroup


class _NamedProcessGroup:
    """The name and description of a Python process group on torch 2.x without
    :data:`PYTHON_BACKEND`: torch keeps them in a group's device backends, of which such a
    group has none ("ProcessGroup name not set" from ``group.group_name``), so they are kept
    here; functional collectives (DTensor) resolve the group by this name. It is also its own
    backend for every device (``_get_backend``)."""

    _cohort_name = ""
    _cohort_desc = ""

    def _set_group_name(self, name: str) -> None:
        self._cohort_name = name

    def _set_group_desc(self, desc: str) -> None:
        self._cohort_desc = desc

    @property
    def group_name(self) -> str:
        """The group's name, as torch set it."""
        return self._cohort_name

    @property
    def group_desc(self) -> str:
        """The group's description, as torch set it."""
        return self._cohort_desc

    def _get_backend(self, device: Any) -> Any:
        """The group is its own backend, for every device (torch 2.15's ``batch_isend_irecv``
        asks the group's backend whether it coalesces)."""
        return self


_BASES: tuple[Any, ...] = (_NamedProcessGroup, _Base) if TORCH2 and not PYTHON_BACKEND else (_Base,)
"""The bases of the backends written in Python here (:class:`CohortBackend`, the managed one)."""


def _input(call: str, t: torch.Tensor) -> torch.Tensor:
    _on_cpu(call, t)
    return t.contiguous()


def _start_each(
    call: str,
    tensors: list[torch.Tensor],
    start: Callable[[torch.Tensor], Work],
    root: Optional[int] = None,
    me: int = 0,
) -> tuple[list[Work], tuple[cuda.Staged, ...]]:
    """Starts ``start(t)`` for each tensor in place: a CPU tensor directly, a CUDA one staged
    through pinned host memory (:mod:`cohort.torch.cuda`). ``root``: a broadcast's root (its
    tensor is copied down and not back; the others' the other way round); ``me``: this rank."""
    for t in tensors:  # every tensor is checked before any collective starts
        if t.device.type != "cuda":
            _output(call, t)
        elif not t.is_contiguous():
            raise InvalidArgumentError(f"cohort backend: {call}: the output tensor must be contiguous")
    works: list[Work] = []
    staged: list[cuda.Staged] = []
    try:
        for t in tensors:
            if t.device.type == "cuda":
                down = root is None or root == me
                up = root is None or root != me
                staged.append(cuda.stage(t, start, down=down, up=up))
            else:
                works.append(start(t))
    except BaseException:
        # Tensors already started finish (their buffers stay alive until then) before the error.
        for work in works:
            try:
                work.wait()
            except Exception:  # noqa: BLE001, S110 - the call's own error is raised
                pass
        for s in staged:
            _finish_staged(s, None)
        raise
    return works, tuple(staged)


def _on_cpu(call: str, t: torch.Tensor) -> None:
    if t.device.type != "cpu":
        raise InvalidArgumentError(
            f"cohort backend: {call}: a tensor is on {t.device}; cohort runs CPU tensors, and CUDA tensors in "
            f"{', '.join(cuda.STAGED_CALLS)} (staged through host memory; for the rest use cohort.torch.managed "
            "with nccl)"
        )


def _output(call: str, t: torch.Tensor) -> torch.Tensor:
    _on_cpu(call, t)
    if not t.is_contiguous():
        raise InvalidArgumentError(f"cohort backend: {call}: the output tensor must be contiguous")
    return t


def _equal_splits(call: str, splits: Any, numel: int, size: int) -> None:
    if splits and len(set(splits)) > 1:
        raise RuntimeError(
            f"cohort backend: {call} with uneven splits {list(splits)} is not supported "
            "(cohort's alltoall exchanges equal blocks)"
        )
    if numel % size:
        raise InvalidArgumentError(f"cohort backend: {call}: {numel} elements do not split over {size} ranks")


class CohortBackend(*_BASES):  # type: ignore[misc]
    """The ``"cohort"`` backend of ``torch.distributed`` over the current cohort communicator of
    ``source`` (see the module docs for the calls it supports).

    On torch 2.x it is a ``c10d.Backend`` that torch registers for the CPU device of its own
    ``ProcessGroup`` (so group names, ``DeviceMesh``, DTensor and FSDP2 see an ordinary group);
    on torch 1.13 it is the ``ProcessGroup`` itself. Each method keeps torch's name and
    signature and forwards to one of the communicator's collectives (queued ones where cohort
    has them, completed in issue order); anything cohort cannot run raises an error naming the
    call.
    """

    def __init__(
        self, source: Source, rank: int, size: int, members: Optional[list[int]] = None, channel: int = 0
    ) -> None:
        super().__init__(rank, size)
        self._source = source
        # A subgroup (``new_group``, a DeviceMesh dimension): its members' ranks in the
        # generation, and the channel its messages carry on the generation's links.
        self._members = members
        self._channel = channel
        # The subgroup's communicator, made from the generation's current one on first use.
        self._sub: Optional[tuple[Communicator, Communicator]] = None
        global _completer
        if _completer is None:
            _completer = _Completer()
        self._completer = _completer

    def _comm(self) -> Communicator:
        comm = _current(self._source)
        if self._members is not None:
            if self._sub is None or self._sub[0] is not comm:
                if comm.size <= max(self._members):
                    raise InvalidArgumentError(
                        f"the cohort process group over ranks {self._members} outlived its generation: the current "
                        f"one has {comm.size} ranks; call cohort.torch.init_process_group again and make the groups "
                        "(or the DeviceMesh) anew"
                    )
                self._sub = (comm, comm.subgroup(self._members, self._channel))
            comm = self._sub[1]
        if comm.size != self.size() or comm.rank != self.rank():
            raise InvalidArgumentError(
                f"the cohort process group was made for rank {self.rank()} of {self.size()}, but the current "
                f"generation has this worker as rank {comm.rank} of {comm.size}: call "
                "cohort.torch.init_process_group again after a re-formation that changes the world"
            )
        return comm

    def getBackendName(self) -> str:  # noqa: N802 - torch's name
        """The backend's name, ``"cohort"``."""
        return BACKEND

    def shutdown(self) -> None:
        """torch's ``destroy_process_group``: a subgroup closes its communicator at once (its
        queued calls finish first) and frees its channel; the generation's own communicator
        belongs to the elastic state, which closes it."""
        if self._members is None:
            return
        if self._sub is not None:
            self._sub[1].close()
            self._sub = None
        others = [ref for ref in _channels.get(self._channel, []) if ref() not in (None, self)]
        if others:
            _channels[self._channel] = others
        else:
            _channels.pop(self._channel, None)

    def _get_backend_name(self) -> str:
        return BACKEND

    # -- what torch asks a backend it may not support (torch 2.x) ------------------------------
    # torch reads these through the Python object; a property left to the C++ base class
    # called back into Python and recursed (dist.batch_isend_irecv raised RecursionError).
    @property
    def supports_coalescing(self) -> bool:
        """False: ``batch_isend_irecv`` and ``_coalescing_manager`` issue the calls one by one."""
        return False

    @property
    def supports_splitting(self) -> bool:
        """False: ``split_group`` is not supported (``new_group`` is)."""
        return False

    @property
    def supports_time_estimate(self) -> bool:
        """False."""
        return False

    @property
    def supports_shrinking(self) -> bool:
        """False: cohort re-forms the generation instead (:meth:`reconfigure`)."""
        return False

    @property
    def supports_window(self) -> bool:
        """False."""
        return False

    # -- torch's fault-tolerance hooks (torch 2.x: dist._supports_reconfigure, ...) -----------
    @property
    def supports_reconfigure(self) -> bool:
        """True for the world group: :meth:`reconfigure` binds it to a generation cohort formed."""
        return self._members is None

    def get_reconfigure_handle(self) -> str:
        """This worker's handle for ``dist._reconfigure``: its cohort worker id."""
        return _own_member(_current(self._source)).worker_id

    def reconfigure(self, opts: Any) -> Any:
        """``dist._reconfigure(uuid, handles)``: binds the group to the source's current
        generation, which must hold exactly ``handles`` (the members' worker ids; a list gives
        them in rank order, a set in any). cohort's coordinator is the quorum: re-form through
        cohort first (``state.reform()``, ``cohort.elastic.run``), then reconfigure. torch keeps
        a group's size and this process's rank, so the generation must keep both; otherwise
        call :func:`init_process_group` again. The uuid is kept as ``reconfigured_uuid``.

        Collective (every rank of the world calls it, as torch's hook is called): each rank
        checks its own place in ``handles`` (its worker id at its rank, or in the set, and as
        many handles as ranks), then one 34-byte max-allreduce agrees on every rank's verdict
        and on a digest of ``handles`` (that every rank passed the same ones). So the check
        needs no member list, which in a generation above the coordinator's
        ``whole_answer_up_to`` holds only this rank's known entries; a mismatch anywhere raises
        ``InvalidArgumentError`` on every rank. A collective failure meanwhile raises it."""
        if self._members is not None:
            raise InvalidArgumentError("cohort backend: reconfigure the world group; its subgroups follow it")
        comm = _current(self._source)
        me = _own_member(comm).worker_id
        handles = opts.handles
        ordered = isinstance(handles, (list, tuple))
        wanted = list(handles) if ordered else sorted(handles)
        if ordered:
            placed = len(wanted) == comm.size and wanted[comm.rank] == me
        else:
            placed = len(set(wanted)) == len(wanted) == comm.size and me in wanted
        kept = comm.size == self.size() and comm.rank == self.rank()
        digest = list(hashlib.sha256(repr((ordered, wanted)).encode()).digest()[:16])
        verdict = torch.tensor([not placed, not kept, *digest, *(255 - b for b in digest)], dtype=torch.uint8)
        comm.allreduce(verdict, "max")
        agreed = verdict.tolist()
        # max(d) == 255 - max(255 - d) == min(d): every rank passed handles of the same digest.
        same = all(agreed[2 + i] == 255 - agreed[18 + i] for i in range(16))
        if agreed[0] or not same:
            wrong = (
                f"generation {comm.generation} holds other members"
                if agreed[0]
                else f"the ranks of generation {comm.generation} passed different handles"
            )
            raise InvalidArgumentError(
                f"cohort backend: reconfigure to {wanted}, but {wrong} (this worker, {me!r}, is its rank {comm.rank} "
                f"of {comm.size}; the handles are its members' worker ids in rank order, or a set of them, the same "
                "on every rank): re-form through cohort first (state.reform()), whose coordinator picks the members"
            )
        if agreed[1]:
            raise InvalidArgumentError(
                f"cohort backend: reconfigure: generation {comm.generation} does not keep torch's ranks (this worker "
                f"is its rank {comm.rank} of {comm.size}, torch keeps this group as rank {self.rank()} of "
                f"{self.size()}; every rank must keep its own): call cohort.torch.init_process_group again"
            )
        self.reconfigured_uuid = opts.uuid
        return _done(None)

    # -- reductions ------------------------------------------------------------------------
    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        """Element-wise reduction of each tensor over the ranks, in place (queued)."""
        op = _op_name("allreduce", opts)
        comm = self._comm()
        works, staged = _start_each("allreduce", tensors, lambda t: comm.allreduce_async(t, op))
        return self._completer.submit(works, tensors, staged=staged)

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        """:meth:`allreduce` of several tensors, one work for all."""
        op = _op_name("allreduce_coalesced", opts)
        comm = self._comm()
        works, staged = _start_each("allreduce_coalesced", tensors, lambda t: comm.allreduce_async(t, op))
        return self._completer.submit(works, tensors, staged=staged)

    def reduce(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        """The root's tensor receives the reduction over the ranks."""
        op = _op_name("reduce", opts)
        comm = self._comm()
        for t in tensors:
            comm.reduce(_output("reduce", t), opts.rootRank if opts is not None else 0, op)
        return _done(tensors)

    def _reduce_scatter_one(self, call: str, comm: Communicator, out: torch.Tensor, inp: torch.Tensor, op: str) -> Work:
        return comm.reduce_scatter_async(_input(call, inp), _output(call, out), op)

    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> Any:  # noqa: A002
        """Rank r receives the reduction of every rank's block r of ``input`` (queued); torch
        2.x's name for ``_reduce_scatter_base`` (``dist.reduce_scatter_tensor``)."""
        comm = self._comm()
        op = _op_name("reduce_scatter_tensor", opts)
        return self._completer.submit(
            [self._reduce_scatter_one("reduce_scatter_tensor", comm, output, input, op)], [output]
        )

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter_single_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> Any:
        """:meth:`reduce_scatter_single` of several tensor pairs, one work for all."""
        comm = self._comm()
        op = _op_name("reduce_scatter_tensor_coalesced", opts)
        works = [
            self._reduce_scatter_one("reduce_scatter_tensor_coalesced", comm, o, i, op) for o, i in zip(outputs, inputs)
        ]
        return self._completer.submit(works, outputs)

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    def reduce_scatter(
        self, output_tensors: list[torch.Tensor], input_tensors: list[list[torch.Tensor]], opts: Any = None
    ) -> Any:
        """Rank r receives the reduction of every rank's ``input_tensors[.][r]``."""
        op = _op_name("reduce_scatter", opts)
        comm = self._comm()
        for out, inputs in zip(output_tensors, input_tensors):
            flat = torch.cat([t.reshape(-1) for t in inputs])
            result = torch.empty(out.numel(), dtype=out.dtype)
            comm.reduce_scatter(flat, result, op)
            out.copy_(result.view_as(out))
        return _done(output_tensors)

    # -- gathers and scatters ----------------------------------------------------------------
    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> Any:  # noqa: A002
        """``output`` holds every rank's ``input``, by rank (queued); torch 2.x's name for
        ``_allgather_base`` (``dist.all_gather_into_tensor``)."""
        comm = self._comm()
        work = comm.allgather_async(_input("all_gather_into_tensor", input), _output("all_gather_into_tensor", output))
        return self._completer.submit([work], [output])

    _allgather_base = all_gather_single

    def all_gather_single_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> Any:
        """:meth:`all_gather_single` of several tensor pairs, one work for all."""
        comm = self._comm()
        call = "all_gather_into_tensor_coalesced"
        works = [comm.allgather_async(_input(call, i), _output(call, o)) for o, i in zip(outputs, inputs)]
        return self._completer.submit(works, outputs)

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    def allgather(
        self, output_tensors: list[list[torch.Tensor]], input_tensors: list[torch.Tensor], opts: Any = None
    ) -> Any:
        """``output_tensors[.][r]`` receives rank r's input. A CUDA input (DDP checks its
        parameters' shapes this way) goes through host memory, not pipelined: copied down on
        the current stream, gathered, copied up into CUDA outputs."""
        comm = self._comm()
        for outputs, inp in zip(output_tensors, input_tensors):
            if inp.device.type == "cuda":
                if any(out.device != inp.device for out in outputs):
                    raise InvalidArgumentError("cohort backend: allgather: the outputs must be on the input's device")
                src = inp.detach().contiguous().to("cpu")
            else:
                src = _input("allgather", inp)
            flat = torch.empty(src.numel() * comm.size, dtype=src.dtype)
            comm.allgather(src, flat)
            for r, out in enumerate(outputs):
                out.copy_(flat[r * src.numel() : (r + 1) * src.numel()].view_as(out))
        return _done(output_tensors)

    def allgather_coalesced(
        self, output_lists: list[list[torch.Tensor]], input_list: list[torch.Tensor], opts: Any = None
    ) -> Any:
        """:meth:`allgather` of several tensors."""
        return self.allgather(output_lists, input_list, opts)

    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        """Copies the root's tensors to every rank (queued)."""
        root = opts.rootRank if opts is not None else 0
        comm = self._comm()
        works, staged = _start_each(
            "broadcast", tensors, lambda t: comm.broadcast_async(t, root), root=root, me=comm.rank
        )
        return self._completer.submit(works, tensors, staged=staged)

    def gather(
        self, output_tensors: list[list[torch.Tensor]], input_tensors: list[torch.Tensor], opts: Any = None
    ) -> Any:
        """The root's ``output_tensors[0][r]`` receives rank r's input."""
        comm = self._comm()
        root = opts.rootRank if opts is not None else 0
        if len(input_tensors) != 1:
            raise InvalidArgumentError(f"cohort backend: gather takes one input tensor, got {len(input_tensors)}")
        src = _input("gather", input_tensors[0])
        flat = torch.empty(src.numel() * comm.size, dtype=src.dtype) if comm.rank == root else None
        comm.gather(src, flat, root)
        if flat is not None:
            for r, out in enumerate(output_tensors[0]):
                out.copy_(flat[r * src.numel() : (r + 1) * src.numel()].view_as(out))
        return _done(output_tensors)

    def gather_into_tensor(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> Any:  # noqa: A002
        """The root's ``output`` holds every rank's ``input``, by rank."""
        comm = self._comm()
        root = opts.rootRank if opts is not None else 0
        comm.gather(
            _input("gather_into_tensor", input),
            _output("gather_into_tensor", output) if comm.rank == root else None,
            root,
        )
        return _done([output])

    def scatter(
        self, output_tensors: list[torch.Tensor], input_tensors: list[list[torch.Tensor]], opts: Any = None
    ) -> Any:
        """Rank r's ``output_tensors[0]`` receives the root's ``input_tensors[0][r]``."""
        comm = self._comm()
        root = opts.rootRank if opts is not None else 0
        if len(output_tensors) != 1:
            raise InvalidArgumentError(f"cohort backend: scatter takes one output tensor, got {len(output_tensors)}")
        out = _output("scatter", output_tensors[0])
        flat = torch.cat([t.reshape(-1) for t in input_tensors[0]]) if comm.rank == root else None
        comm.scatter(flat, out, root)
        return _done(output_tensors)

    def all_to_all_single(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_split_sizes: Any = None,  # noqa: A002
        input_split_sizes: Any = None,
        opts: Any = None,
    ) -> Any:
        """Block j of this rank's ``input`` lands in block (this rank) of rank j's ``output``
        (``dist.all_to_all_single``; equal splits only); torch 2.x's name for ``alltoall_base``."""
        comm = self._comm()
        for splits in (output_split_sizes, input_split_sizes):
            _equal_splits("all_to_all_single", splits, input.numel(), comm.size)
        comm.alltoall(_input("all_to_all_single", input), _output("all_to_all_single", output))
        return _done([output])

    alltoall_base = all_to_all_single

    def alltoall(self, output_tensors: list[torch.Tensor], input_tensors: list[torch.Tensor], opts: Any = None) -> Any:
        """``output_tensors[j]`` receives rank j's ``input_tensors[this rank]`` (equal sizes)."""
        comm = self._comm()
        sizes = {t.numel() for t in [*input_tensors, *output_tensors]}
        if len(sizes) > 1:
            raise RuntimeError(
                f"cohort backend: all_to_all with tensors of different sizes {sorted(sizes)} is not "
                "supported (cohort's alltoall exchanges equal blocks)"
            )
        flat_in = torch.cat([t.reshape(-1) for t in input_tensors])
        flat_out = torch.empty_like(flat_in)
        comm.alltoall(flat_in, flat_out)
        n = flat_in.numel() // max(comm.size, 1)
        for r, out in enumerate(output_tensors):
            out.copy_(flat_out[r * n : (r + 1) * n].view_as(out))
        return _done(output_tensors)

    def barrier(self, opts: Any = None) -> Any:
        """Returns once every rank has entered it."""
        self._comm().barrier()
        return _done([])

    # -- point to point ----------------------------------------------------------------------
    def _lane(self, call: str, peer: int, send: bool) -> _Lane:
        """The lane to or from this group's rank ``peer`` (:class:`_Lanes`)."""
        group = self._comm()  # checks that the group still matches the generation
        if not 0 <= peer < group.size or peer == group.rank:
            raise InvalidArgumentError(
                f"cohort backend: {call}: rank {peer} is not another rank of the group "
                f"({group.size} ranks, this worker is rank {group.rank})"
            )
        return _lanes_of(_current(self._source)).lane(call, self._members[peer] if self._members else peer, send)

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int = 0) -> Any:
        """Sends to rank ``dst``, matched in order with its :meth:`recv` (tag 0 only). Queued
        on the lane to ``dst`` (:class:`_Lane`): it waits for no receive or collective here."""
        _no_tag("send", tag)
        inputs = [_input("send", t) for t in tensors]

        def run(comm: Communicator, peer: int) -> None:
            for t in inputs:
                comm.send(t, peer)

        return self._lane("send", dst, True).submit(run, tensors)

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int = 0) -> Any:
        """Receives from rank ``src``, matched in order with its :meth:`send` (tag 0 only).
        Queued on the lane from ``src``: a receive posted first does not hold up the sends."""
        _no_tag("recv", tag)
        outputs = [_output("recv", t) for t in tensors]

        def run(comm: Communicator, peer: int) -> None:
            for t in outputs:
                comm.recv(t, peer)

        return self._lane("recv", src, False).submit(run, tensors)

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int = 0) -> Any:
        """Not supported: raises, naming the call."""
        raise RuntimeError("cohort backend: recv from any source is not supported (name the source rank)")

    def monitored_barrier(self, opts: Any = None, wait_all_ranks: bool = False) -> Any:
        """Not supported: raises, naming the call (cohort's :meth:`barrier` already fails with
        the root cause, naming the rank, when a rank is missing)."""
        raise RuntimeError(
            "cohort backend: monitored_barrier is not supported; use barrier(), which fails "
            "naming the rank that failed first"
        )

    def allreduce_sparse(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        """Not supported: raises, naming the call."""
        raise RuntimeError("cohort backend: allreduce of sparse tensors is not supported")


CohortProcessGroup = CohortBackend
"""The name of :class:`CohortBackend` before torch 2.x support (on torch 1.13 it is the process
group)."""


def _no_tag(call: str, tag: int) -> None:
    if tag != 0:
        raise RuntimeError(
            f"cohort backend: {call} with tag {tag}: tags are not supported; cohort matches "
            "sends and receives between two ranks in order (use tag 0)"
        )


def _create(store: Any, rank: int, size: int, timeout: Any) -> CohortBackend:
    """torch 1.13's backend creator: the whole generation only (1.13 tells a creator nothing
    about which ranks a ``new_group`` holds)."""
    if _pending_source is None:
        raise RuntimeError("use cohort.torch.init_process_group(state) to start the cohort backend")
    comm = _current(_pending_source)
    if size != comm.size or rank != comm.rank:
        raise RuntimeError(
            f"cohort backend: new_group of {size} ranks (this worker as rank {rank}) needs torch 2.x: on torch "
            f"{torch.__version__} a cohort process group spans the whole generation ({comm.size} ranks, this "
            f"worker as rank {comm.rank})"
        )
    if _barrier_store is not None:
        from torch.distributed import distributed_c10d as c10d

        _barrier_store.created.add(c10d._group_count)
    return CohortBackend(_pending_source, rank, size)


class _BarrierStore(_C10D.Store):  # type: ignore[misc]
    """torch 1.13's store for the cohort group: private to this process (cohort's rendezvous
    formed the group), except for the store-based barrier that 1.13 runs at the end of
    ``init_process_group`` and of every ``new_group``, on every rank, counting the ranks in a
    store they share. Here the barrier passes for a group whose backend this process made
    (``created``; every rank makes it, and the group's first call checks that they agree), and
    a process left out of a ``new_group`` over some of the ranks, which 1.13 never asks to
    make the backend, raises the error its members raise, instead of waiting for ranks that
    never count in its store."""

    def __init__(self, comm: Communicator) -> None:
        super().__init__()
        self._store = _C10D.HashStore()
        self._size, self._rank = comm.size, comm.rank
        self.created: set[int] = set()

    def add(self, key: str, value: int) -> int:
        from torch.distributed import distributed_c10d as c10d

        prefix = f"{c10d.STORE_BASED_BARRIER_PREFIX}:"
        if not key.startswith(prefix):
            return self._store.add(key, value)
        if int(key[len(prefix) :]) not in self.created:
            raise RuntimeError(
                f"cohort backend: new_group over some of the ranks needs torch 2.x: on torch {torch.__version__} a "
                f"cohort process group spans the whole generation ({self._size} ranks; this worker, rank "
                f"{self._rank}, is not in the new group)"
            )
        return self._size

    def set(self, key: str, value: Any) -> None:
        self._store.set(key, value)

    def get(self, key: str) -> bytes:
        return self._store.get(key)

    def compare_set(self, key: str, expected: Any, desired: Any) -> bytes:
        return self._store.compare_set(key, expected, desired)

    def delete_key(self, key: str) -> bool:
        return self._store.delete_key(key)

    def num_keys(self) -> int:
        return self._store.num_keys()

    def set_timeout(self, timeout: Any) -> None:
        self._store.set_timeout(timeout)

    def wait(self, keys: list[str], timeout: Any = None) -> None:
        if timeout is None:
            self._store.wait(keys)
        else:
            self._store.wait(keys, timeout)


_barrier_store: Optional[_BarrierStore] = None


MAX_CHANNEL = 4094
"""Subgroups' channels are 1 to ``MAX_CHANNEL`` (0 is the generation's own communicator,
:data:`P2P_CHANNEL` its point-to-point lanes)."""

P2P_CHANNEL = 4095
"""The channel of point-to-point messages (:class:`_Lanes`), kept apart from every group's."""


def subgroup_channel(group_name: str) -> int:
    """The channel of the torch group named ``group_name``, the same on every rank: torch names a
    group by a counter every rank advances at every ``new_group`` (or, for groups made with local
    synchronisation, by a hash of the ranks and that counter), so groups made one after the other
    get different channels until the 4094th (a collision is refused, see :func:`_create_extended`)."""
    n = int(group_name) if group_name.isdigit() else int.from_bytes(group_name.encode(), "little") % (1 << 61)
    return n % MAX_CHANNEL + 1


class _Lane:
    """One direction of point-to-point traffic between this worker and one peer: a two-rank
    subgroup of the generation on :data:`P2P_CHANNEL` (the sender its rank 0, the receiver its
    rank 1), and a thread that runs the direction's sends (or receives) in issue order.

    A send and a receive therefore never wait for each other, nor for a collective, as gloo's
    do not: ``irecv`` then ``isend`` around a ring, or both ranks of a pair receiving first,
    completes. On the link between two workers the two directions share the channel, but each
    direction's messages are sent by one lane only and received by the other's peer lane, so
    they are never taken for each other."""

    def __init__(self, comm: Communicator, peer_rank: int, name: str) -> None:
        self.comm = comm
        self._peer_rank = peer_rank  # the peer's rank in the two-rank subgroup
        self._queue: "queue.Queue[Optional[tuple[Callable[[Communicator, int], None], Future, _Outcome, Any]]]" = (
            queue.Queue()
        )
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            run, fut, outcome, result = job
            try:
                run(self.comm, self._peer_rank)
            except BaseException as e:  # noqa: BLE001 - handed to the Work's waiter
                _handed_on(e)
                outcome.error = e
            fut.set_result(result)

    def submit(self, run: Callable[[Communicator, int], None], result: Any) -> Any:
        """A torch ``Work`` that completes once ``run(comm, peer)`` has; ``wait()`` raises its
        error on either torch."""
        fut: Future = Future()
        outcome = _Outcome()
        self._queue.put((run, fut, outcome, result))
        return _work(fut, outcome, python_work=True)

    def stop(self) -> None:
        """Lets the thread end once its queued calls have run."""
        self._queue.put(None)


class _Lanes:
    """The point-to-point lanes of one generation's communicator, one per peer and direction,
    made on first use. Messages between two workers are matched in order per direction,
    whatever torch group they were sent in (groups' ranks are mapped to the generation's)."""

    def __init__(self, comm: Communicator) -> None:
        self.comm = comm
        self._lanes: dict[tuple[int, bool], _Lane] = {}
        self._lock = threading.Lock()

    def lane(self, call: str, peer: int, send: bool) -> _Lane:
        """The lane to (``send``) or from rank ``peer`` of the generation."""
        me = self.comm.rank
        if not 0 <= peer < self.comm.size or peer == me:
            raise InvalidArgumentError(
                f"cohort backend: {call}: rank {peer} is not another rank of the generation "
                f"({self.comm.size} ranks, this worker is rank {me})"
            )
        with self._lock:
            lane = self._lanes.get((peer, send))
            if lane is None:
                ranks = [me, peer] if send else [peer, me]
                name = f"cohort-p2p-{'to' if send else 'from'}-{peer}-g{self.comm.generation}"
                lane = _Lane(self.comm.subgroup(ranks, P2P_CHANNEL), 1 if send else 0, name)
                self._lanes[(peer, send)] = lane
            return lane

    def stop(self) -> None:
        """Ends the lanes' threads once their queued calls have run (their communicators close
        with the generation's)."""
        with self._lock:
            for lane in self._lanes.values():
                lane.stop()
            self._lanes.clear()


_lanes: Optional[_Lanes] = None
_lanes_lock = threading.Lock()


def _lanes_of(comm: Communicator) -> _Lanes:
    """The point-to-point lanes of ``comm`` (those of an earlier generation are stopped)."""
    global _lanes
    with _lanes_lock:
        if _lanes is None or _lanes.comm is not comm:
            if _lanes is not None:
                _lanes.stop()
            _lanes = _Lanes(comm)
        return _lanes


# The live subgroup backends of every channel (weak references), for the collision check.
_channels: "dict[int, list[Any]]" = {}


def _create_extended(opts: Any, _backend_options: Any) -> CohortBackend:
    """torch 2.x's backend creator (``extended_api``): the whole generation, or a subgroup of it
    (``new_group``, each dimension of a ``DeviceMesh``) over the generation's links."""
    import weakref

    if _pending_source is None:
        raise RuntimeError("use cohort.torch.init_process_group(state) to start the cohort backend")
    comm = _current(_pending_source)
    ranks = list(opts.global_ranks_in_group)
    rank, size = opts.group_rank, opts.group_size
    if not ranks or ranks == list(range(comm.size)):
        return _create(opts.store, rank, size, opts.timeout)
    if len(ranks) != size or ranks[rank] != comm.rank:
        raise RuntimeError(
            f"cohort backend: group {opts.group_id!r} of ranks {ranks} does not hold this worker (rank {comm.rank}) "
            f"as its rank {rank} of {size}"
        )
    channel = subgroup_channel(str(opts.group_id))
    live = [b for b in (ref() for ref in _channels.get(channel, [])) if b is not None]
    for other in live:
        # Two members in common are a link in common, whose messages the two would mix.
        if len(set(other._members) & set(ranks)) >= 2:
            raise RuntimeError(
                f"cohort backend: group {opts.group_id!r} of ranks {ranks} would share channel {channel} with the "
                f"live group of ranks {other._members}; destroy that group first (channels come from torch's group "
                "names, see docs/python.md)"
            )
    backend = CohortBackend(_pending_source, rank, size, members=ranks, channel=channel)
    _channels[channel] = [weakref.ref(b) for b in live] + [weakref.ref(backend)]
    return backend


_pending_source: Optional[Source] = None
_registered = False


def _register() -> None:
    global _registered
    if _registered:
        return
    if TORCH2:
        # The CPU device, so that torch neither warns nor guesses (and routes CPU tensors here);
        # and CUDA where there is one (all_reduce and broadcast stage through host memory).
        devices = ["cpu", "cuda"] if torch.cuda.is_available() else ["cpu"]
        dist.Backend.register_backend(BACKEND, _create_extended, extended_api=True, devices=devices)
    else:
        dist.Backend.register_backend(BACKEND, _create)
    _registered = True


def init_process_group(source: Union[Source, Group]) -> Any:
    """Makes the ``"cohort"`` backend the default ``torch.distributed`` group for the current
    generation of ``source`` (an elastic state or a communicator), replacing any earlier one,
    and returns that group.

    No address, port or store to configure: cohort's rendezvous already formed the group.
    ``source`` must have a current generation: inside a function run by
    :func:`cohort.elastic.run` (or in its reset callbacks), or after ``state.reform()`` or
    ``group.next_generation()``. Afterwards ``dist.get_rank()``, ``dist.all_reduce``,
    ``DistributedDataParallel(model)``, ``init_device_mesh("cpu", (world,))`` and FSDP2's
    ``fully_shard`` work as with any backend.
    """
    if isinstance(source, Group):
        raise InvalidArgumentError("pass the elastic state or the communicator (group.next_generation())")
    comm = _current(source)
    _register()
    if dist.is_initialized():
        dist.destroy_process_group()
    global _pending_source, _barrier_store, _lanes
    _pending_source = source
    with _lanes_lock:
        if _lanes is not None and _lanes.comm is not comm:
            _lanes.stop()  # an earlier generation's point-to-point lanes
            _lanes = None
    from torch.distributed import distributed_c10d as c10d

    # torch 1.13's init_process_group and new_group end with a barrier that counts the ranks
    # in a store they share; cohort's rendezvous already formed the group (_BarrierStore).
    store = dist.HashStore() if TORCH2 else _BarrierStore(comm)
    _barrier_store = None if TORCH2 else store
    dist.init_process_group(BACKEND, store=store, rank=comm.rank, world_size=comm.size)
    return c10d._get_default_group()
