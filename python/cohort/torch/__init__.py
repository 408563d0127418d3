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

Supported ``ProcessGroup`` calls (torch 1.13): ``allreduce`` (SUM, PRODUCT, MIN, MAX, AVG;
asynchronous), ``broadcast`` (asynchronous), ``allgather``, ``reduce_scatter``, ``barrier``,
``send``, ``recv``, ``reduce``. Not supported (they raise ``RuntimeError``): ``gather``,
``scatter``, ``alltoall`` with uneven splits, coalesced variants, ``recv_anysource``,
``monitored_barrier``. CPU tensors only, contiguous, dtypes float32/float64/float16/bfloat16/
int32/int64/uint8.
"""

from __future__ import annotations

import queue
import threading
from typing import Any, Callable, Optional, Union

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import ProcessGroup, _create_work_from_future
from torch.futures import Future

from cohort._native import Communicator, Group, Work
from cohort.errors import InvalidArgumentError

__all__ = ["GradientAverager", "CohortProcessGroup", "init_process_group", "BACKEND"]

BACKEND = "cohort"
"""The name of the ``torch.distributed`` backend."""

Source = Union[Communicator, Any]
"""A communicator, or anything with a ``comm`` attribute (a :class:`cohort.elastic.State`)."""


def _current(source: Source) -> Communicator:
    comm = source if isinstance(source, Communicator) else getattr(source, "comm", None)
    if comm is None:
        raise RuntimeError("no current communicator: re-form first (cohort.elastic.run does)")
    return comm


class GradientAverager:
    """Averages the gradients of ``model`` over the ranks, in buckets, overlapped with backward.

    ``source`` is the communicator, or an elastic state whose ``comm`` is the current one.
    ``op`` is "avg" (the mean over ranks, as DDP) or "sum" (for a loss already scaled by the
    global batch). Buckets hold parameters in reverse registration order (about the order backward produces
    their gradients) up to ``bucket_bytes`` each; every rank launches them in the same order.
    After ``synchronize()`` each parameter's ``.grad`` is a view into its bucket, so the next
    backward accumulates in place and no copy is needed (``zero_grad()`` keeps the views;
    ``set_to_none=True`` only costs one copy per parameter).
    """

    def __init__(self, model: torch.nn.Module, source: Source, bucket_bytes: int = 4 << 20, op: str = "avg") -> None:
        if bucket_bytes <= 0:
            raise ValueError("bucket_bytes must be positive")
        if op not in ("avg", "sum"):
            raise ValueError("op must be 'avg' (mean over ranks) or 'sum' (the loss is already scaled)")
        self.source = source
        self.op = op
        params = [p for p in model.parameters() if p.requires_grad]
        for p in params:
            if p.device.type != "cpu":
                raise InvalidArgumentError(f"GradientAverager: a parameter is on {p.device}; cohort averages CPU tensors")
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
        """Removes the autograd hooks (before making another averager for the same model)."""
        for _accumulator, handle in self._hooks:
            handle.remove()
        self._hooks.clear()

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
            self.views.append(self.flat[offset:offset + p.numel()].view_as(p))
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


def _op_name(op: Any) -> str:
    for key, name in _REDUCE_OPS.items():
        if op == key:
            return name
    raise RuntimeError(f"cohort backend: reduce op {op} is not supported (sum, product, min, max, avg)")


class _Completer:
    """Completes torch futures from cohort Works on one thread, in issue order."""

    def __init__(self) -> None:
        self._queue: "queue.Queue[tuple[Work, Future, Any]]" = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="cohort-torch-completer", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            work, fut, result = self._queue.get()
            try:
                work.wait()
            except BaseException as e:  # noqa: BLE001 - handed to the future's waiter
                fut.set_exception(e)
            else:
                fut.set_result(result)

    def submit(self, work: Work, result: Any) -> Any:
        fut: Future = Future()
        self._queue.put((work, fut, result))
        return _create_work_from_future(fut)


_completer: Optional[_Completer] = None


def _done(result: Any) -> Any:
    fut: Future = Future()
    fut.set_result(result)
    return _create_work_from_future(fut)


class CohortProcessGroup(ProcessGroup):
    """A ``torch.distributed`` process group over the current cohort communicator of
    ``source`` (see the module docs for the supported calls)."""

    def __init__(self, source: Source, rank: int, size: int) -> None:
        super().__init__(rank, size)
        self._source = source
        global _completer
        if _completer is None:
            _completer = _Completer()
        self._completer = _completer

    def _comm(self) -> Communicator:
        comm = _current(self._source)
        if comm.size != self.size() or comm.rank != self.rank():
            raise InvalidArgumentError(
                f"the cohort process group was made for rank {self.rank()} of {self.size()}, but the current "
                f"generation has this worker as rank {comm.rank} of {comm.size}: call "
                "cohort.torch.init_process_group again after a re-formation that changes the world"
            )
        return comm

    def getBackendName(self) -> str:  # noqa: N802 - torch's name
        return BACKEND

    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        op = _op_name(opts.reduceOp) if opts is not None else "sum"
        comm = self._comm()
        if len(tensors) == 1:
            return self._completer.submit(comm.allreduce_async(tensors[0], op), tensors)
        for t in tensors:
            comm.allreduce(t, op)
        return _done(tensors)

    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        root = opts.rootRank if opts is not None else 0
        comm = self._comm()
        if len(tensors) == 1:
            return self._completer.submit(comm.broadcast_async(tensors[0], root), tensors)
        for t in tensors:
            comm.broadcast(t, root)
        return _done(tensors)

    def allgather(self, output_tensors: list[list[torch.Tensor]], input_tensors: list[torch.Tensor],
                  opts: Any = None) -> Any:
        comm = self._comm()
        for outputs, inp in zip(output_tensors, input_tensors):
            src = inp.contiguous()
            flat = torch.empty(src.numel() * comm.size, dtype=src.dtype)
            comm.allgather(src, flat)
            for r, out in enumerate(outputs):
                out.copy_(flat[r * src.numel():(r + 1) * src.numel()].view_as(out))
        return _done(output_tensors)

    def reduce_scatter(self, output_tensors: list[torch.Tensor], input_tensors: list[list[torch.Tensor]],
                       opts: Any = None) -> Any:
        op = _op_name(opts.reduceOp) if opts is not None else "sum"
        comm = self._comm()
        for out, inputs in zip(output_tensors, input_tensors):
            flat = torch.cat([t.reshape(-1) for t in inputs])
            result = torch.empty(out.numel(), dtype=out.dtype)
            comm.reduce_scatter(flat, result, op)
            out.copy_(result.view_as(out))
        return _done(output_tensors)

    def reduce(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        op = _op_name(opts.reduceOp) if opts is not None else "sum"
        comm = self._comm()
        for t in tensors:
            comm.reduce(t, opts.rootRank if opts is not None else 0, op)
        return _done(tensors)

    def barrier(self, opts: Any = None) -> Any:
        self._comm().barrier()
        return _done([])

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int = 0) -> Any:
        comm = self._comm()
        for t in tensors:
            comm.send(t, dst)
        return _done(tensors)

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int = 0) -> Any:
        comm = self._comm()
        for t in tensors:
            comm.recv(t, src)
        return _done(tensors)


def _create(store: Any, rank: int, size: int, timeout: Any) -> CohortProcessGroup:
    if _pending_source is None:
        raise RuntimeError("use cohort.torch.init_process_group(state) to start the cohort backend")
    return CohortProcessGroup(_pending_source, rank, size)


_pending_source: Optional[Source] = None
_registered = False


def init_process_group(source: Union[Source, Group]) -> CohortProcessGroup:
    """Makes the ``"cohort"`` backend the default ``torch.distributed`` group for the current
    generation of ``source`` (an elastic state or a communicator), replacing any earlier one.

    No address, port or store to configure: cohort's rendezvous already formed the group.
    Afterwards ``dist.get_rank()``, ``dist.all_reduce`` and ``DistributedDataParallel(model)``
    work as with any backend.
    """
    global _pending_source, _registered
    if isinstance(source, Group):
        raise InvalidArgumentError("pass the elastic state or the communicator (group.next_generation())")
    comm = _current(source)
    if not _registered:
        dist.Backend.register_backend(BACKEND, _create)
        _registered = True
    if dist.is_initialized():
        dist.destroy_process_group()
    _pending_source = source
    store = dist.HashStore()
    # torch 1.13's init_process_group ends with a barrier that counts the ranks in a store
    # they share; cohort's rendezvous already formed the group and each rank's store is
    # private, so tell it every other rank arrived.
    from torch.distributed import distributed_c10d as c10d

    store.add(f"{c10d.STORE_BASED_BARRIER_PREFIX}:{c10d._group_count + 1}", comm.size - 1)
    dist.init_process_group(BACKEND, store=store, rank=comm.rank, world_size=comm.size)
    pg = c10d._get_default_group()
    assert isinstance(pg, CohortProcessGroup)
    return pg
