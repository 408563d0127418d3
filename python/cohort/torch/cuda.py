"""``cohort.torch.cuda``: CUDA tensors on the ``cohort`` backend, staged through pinned host
memory.

cohort's data plane (TCP, shared memory, RDMA) moves host memory. A collective on a CUDA tensor
(``all_reduce``, ``all_reduce_coalesced``, ``broadcast``; ``all_gather`` goes through
host memory whole, see :data:`STAGED_CALLS`) therefore runs in three stages, per
chunk of :data:`CHUNK_BYTES`:

1. **down**: the chunk is copied into a pinned host buffer on the tensor's *current stream*
   (non-blocking, so after whatever that stream was doing: the kernels that produced the
   tensor), and a CUDA event is recorded behind it;
2. **the wire**: the calling thread waits for that one event (``cudaEventSynchronize``, no
   device-wide synchronisation: the GPU's other streams and later kernels keep running) and
   starts the chunk's cohort collective on the host buffer. Every chunk's collective is
   started in the caller's thread and in order, so each rank issues them in the same order as
   its other collectives;
3. **up**: cohort's completer thread waits for each chunk's collective and copies the chunk
   back on a copy stream of the device (non-blocking, from pinned memory), while later
   chunks are still on the wire. The torch ``Work`` completes once the last copy's event has
   completed, so whatever waits for it (``work.wait()``, DDP's future) sees the result in
   device memory, for any stream.

Chunks pipeline: chunk *i* is on the wire while chunk *i+1* is copied down and chunk *i-1*
copied up. The caller's thread returns once the last chunk is down and on the wire (the copy
down of a 1 GiB tensor takes tens of milliseconds), not when the collective is done.

Pinned buffers are taken from a pool (:class:`PinnedPool`) that keeps up to
:data:`POOL_BYTES` of them between calls; pinning memory is a system call and a page-locking
walk, far too slow to do per collective.

What it costs against host tensors is measured in docs/benchmarks.md ("CUDA tensors on the
cohort backend"); for the collectives it does not stage, or for GPU-to-GPU bandwidth, use
:mod:`cohort.torch.managed` with ``backend="nccl"`` (docs/python.md says which to pick).
"""

from __future__ import annotations

import os
import threading
from typing import Any, Callable

import torch

from cohort._native import Work

__all__ = ["CHUNK_BYTES", "POOL_BYTES", "STAGED_CALLS", "PinnedPool", "Staged", "chunks", "stage"]

CHUNK_BYTES: int = int(os.environ.get("COHORT_CUDA_CHUNK_BYTES", str(4 << 20)))
"""The bytes of one pipelined chunk (``COHORT_CUDA_CHUNK_BYTES``; default 4 MiB): large enough
that a chunk's collective is bandwidth-bound, small enough that copies and the wire overlap."""

POOL_BYTES: int = int(os.environ.get("COHORT_CUDA_POOL_BYTES", str(1 << 30)))
"""The most pinned bytes kept between calls (``COHORT_CUDA_POOL_BYTES``; default 1 GiB); a
buffer returned beyond it is freed."""

STAGED_CALLS = ("all_reduce", "all_reduce_coalesced", "broadcast", "all_gather")
"""The calls of the cohort backend that take CUDA tensors: the first three staged and
pipelined as above, ``all_gather`` (a list of outputs; DDP checks its parameters' shapes with it)
copied through host memory whole."""


def chunks(numel: int, element_size: int, chunk_bytes: int) -> list[tuple[int, int]]:
    """The ``[start, end)`` element ranges of a tensor of ``numel`` elements cut into chunks of
    at most ``chunk_bytes`` (at least one element each); one empty range for an empty tensor."""
    if numel == 0:
        return [(0, 0)]
    per = max(1, chunk_bytes // max(1, element_size))
    return [(a, min(a + per, numel)) for a in range(0, numel, per)]


class PinnedPool:
    """Pinned host buffers, reused: :meth:`take` gives one of at least the bytes asked (a power of
    two from 64 KiB up, so that sizes that differ a little share buffers), :meth:`give` returns
    it; up to ``limit`` bytes are kept."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._free: dict[int, list[torch.Tensor]] = {}
        self._kept = 0
        self._lock = threading.Lock()

    @staticmethod
    def _class_of(nbytes: int) -> int:
        size = 64 << 10
        while size < nbytes:
            size <<= 1
        return size

    def take(self, nbytes: int) -> torch.Tensor:
        """A pinned ``uint8`` buffer of at least ``nbytes``."""
        size = self._class_of(nbytes)
        with self._lock:
            free = self._free.get(size)
            if free:
                self._kept -= size
                return free.pop()
        return torch.empty(size, dtype=torch.uint8, pin_memory=True)

    def give(self, buffer: torch.Tensor) -> None:
        """Returns ``buffer`` (no copy may still be reading or writing it)."""
        size = buffer.numel()
        with self._lock:
            if self._kept + size <= self.limit:
                self._free.setdefault(size, []).append(buffer)
                self._kept += size

    @property
    def kept_bytes(self) -> int:
        """The pinned bytes kept for reuse now."""
        return self._kept


_pool = PinnedPool(POOL_BYTES)
_copy_streams: dict[int, Any] = {}
_copy_streams_lock = threading.Lock()


def _copy_stream(device: torch.device) -> Any:
    """The stream of ``device`` on which chunks are copied back (one per device)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    with _copy_streams_lock:
        stream = _copy_streams.get(index)
        if stream is None:
            stream = torch.cuda.Stream(device=index)
            _copy_streams[index] = stream
        return stream


class Staged:
    """One CUDA tensor's collective in flight, staged through a pinned buffer: the cohort Works
    of its chunks, and what the completer does as each finishes (:meth:`chunk_done`), after the
    last (:meth:`finish`) and always (:meth:`release`)."""

    def __init__(self, tensor: torch.Tensor, up: bool) -> None:
        self.tensor = tensor
        self.flat = tensor.view(-1)
        self.up = up
        nbytes = tensor.numel() * tensor.element_size()
        self._buffer = _pool.take(nbytes)
        self.host = self._buffer[:nbytes].view(tensor.dtype)
        self.ranges = chunks(tensor.numel(), tensor.element_size(), CHUNK_BYTES)
        self.works: list[Work] = []
        self._stream = _copy_stream(tensor.device)
        self._events: list[Any] = []

    def chunk_done(self, i: int) -> None:
        """Chunk ``i``'s collective is done: its copy back is queued on the copy stream."""
        if not self.up:
            return
        a, b = self.ranges[i]
        with torch.cuda.stream(self._stream):
            self.flat[a:b].copy_(self.host[a:b], non_blocking=True)
            event = torch.cuda.Event()
            event.record(self._stream)
        self._events.append(event)

    def finish(self) -> None:
        """Every chunk is back in device memory (waits for the last copy's event alone)."""
        if self._events:
            self._events[-1].synchronize()

    def release(self) -> None:
        """Returns the pinned buffer once no copy uses it (after an error too)."""
        for event in self._events:
            event.synchronize()
        self._events.clear()
        _pool.give(self._buffer)


def stage(tensor: torch.Tensor, start: Callable[[torch.Tensor], Work], *, down: bool = True, up: bool = True) -> Staged:
    """Starts ``start(host_chunk)`` (a cohort collective, in place on a host view) for every
    chunk of the contiguous CUDA ``tensor``, pipelined as the module describes. ``down``: copy
    the tensor to the host first (False for a broadcast's receivers); ``up``: copy the result
    back (False for a broadcast's root). The completer calls the :class:`Staged`'s hooks."""
    staged = Staged(tensor, up)
    down_events: list[Any] = []
    try:
        if down:
            stream = torch.cuda.current_stream(tensor.device)
            for a, b in staged.ranges:
                staged.host[a:b].copy_(staged.flat[a:b], non_blocking=True)
                event = torch.cuda.Event()
                event.record(stream)
                down_events.append(event)
            # The copy stream writes the tensor back only after the caller's stream read it.
            staged._stream.wait_event(down_events[-1])
            for (a, b), event in zip(staged.ranges, down_events):
                event.synchronize()
                staged.works.append(start(staged.host[a:b]))
        else:
            staged._stream.wait_stream(torch.cuda.current_stream(tensor.device))
            for a, b in staged.ranges:
                staged.works.append(start(staged.host[a:b]))
    except BaseException:
        for work in staged.works:
            try:
                work.wait()
            except Exception:  # noqa: BLE001, S110 - the call's own error is raised below
                pass
        for event in down_events:
            event.synchronize()
        staged.release()
        raise
    return staged
