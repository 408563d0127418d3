"""``cohort.torch.nccl``: everything about nccl under :mod:`cohort.torch.managed`, and what was
and was not run.

``cohort.torch.managed.init_process_group(state, backend="nccl")`` (torch 2.x, a CUDA device,
torch built with nccl) makes the default group ``cpu:cohort_gloo,cuda:cohort_nccl``: CUDA
tensors go to torch's ``ProcessGroupNCCL``, CPU tensors (object collectives, barriers) to the
managed gloo group, both made per generation through :class:`cohort.torch.Store` under the
generation's scope (torch gives each device's backend its own key prefix). Beyond the gloo
path:

- **Abort**: nccl's kernels cannot be woken by shutting sockets down; on revocation the
  generation's watchdog calls ``ProcessGroupNCCL.abort()`` (``ncclCommAbort`` beneath it). Every
  later call, and ``wait()`` on a call in flight, raises the generation's root cause.
- **Torch's own watchdog stays out of the way**: :func:`prepare_environment` sets
  ``TORCH_NCCL_ASYNC_ERROR_HANDLING=0`` unless the user set it, so that torch does not end the
  process on a timeout before cohort has reported it and every rank learned the cause.
- **The watchdog bound**: a CUDA Work completes on the GPU stream, not on a host thread (its
  future is "complete" once the kernels are queued), so the generation's watchdog asks each
  call's Work (``is_completed``, a CUDA event query) every 0.25 s, and reports a call still
  running after ``timeout`` through cohort, which aborts it on every rank.
- **Works keep torch's stream semantics**: :class:`DeviceWork` forwards ``wait()`` (the current
  stream waits for the collective, the host does not) and ``get_future()`` (DDP's CUDA future)
  to nccl's own Work. A synchronous call (``async_op=False``) on torch 2.11's nccl runs on the
  caller's stream and returns no Work at all; the managed backend returns none either, and the
  watchdog bounds the call by an event recorded behind it (:func:`stream_marker`).

What ran on a GPU is :data:`RUN` (docs/benchmarks.md, "GPU checks", has the dates and the
machine); what did not is :data:`NOT_RUN`. The CPU path (gloo) is tested through kills by
``python/tests/test_managed.py``; the GPU checks are ``python/tests/test_cuda.py``, run by
``scripts/device-check.sh`` on a machine with a GPU.
"""

from __future__ import annotations

import datetime
import os
from typing import Any

import torch
import torch.distributed as dist

from cohort.errors import InvalidArgumentError

__all__ = [
    "RUN",
    "NOT_RUN",
    "DeviceWork",
    "available",
    "check_available",
    "create",
    "prepare_environment",
    "stream_marker",
]

RUN: tuple[str, ...] = (
    "ProcessGroupNCCL made per generation through cohort.torch.Store, beside managed gloo in one default group "
    "(world size 1, one H200, torch 2.11.0, nccl 2.28.9, 2026-11-29)",
    "all_reduce (synchronous: no Work from torch 2.11's nccl) and an async broadcast of CUDA tensors, values checked",
    "the watchdog seeing each nccl call complete (Work.is_completed, and the stream marker of a synchronous call)",
    "abort on revocation through ProcessGroupNCCL.abort(): returned 0.76-0.80 s after the report, and the next "
    "call raised the root cause",
)
"""What of nccl this project has run on a GPU (python/tests/test_cuda.py, by scripts/device-check.sh;
docs/benchmarks.md, "On a GPU")."""

NOT_RUN = (
    "more than one rank: the GPU machine at hand has one GPU, and nccl refuses two ranks on one device",
    "an abort while a collective waits for a peer (needs two GPUs)",
    "the watchdog's bound firing on a hung nccl kernel (needs two GPUs)",
    "DDP, FSDP2 and cohort.hsdp on CUDA tensors through kills, and their kill-to-next-step time",
    "torch 2.15's path (a device backend of torch's group: cpu:cohort_gloo,cuda:cohort_nccl): the GPU machine has 2.11",
)
"""What a managed nccl group does that no command here has run."""


def available() -> bool:
    """Whether this process can make a managed nccl group: torch 2.x with nccl, and a CUDA device."""
    return hasattr(dist, "ProcessGroupNCCL") and dist.is_nccl_available() and torch.cuda.is_available()


def check_available(torch2: bool) -> None:
    """Raises a clear error when :func:`available` is not (or torch is 1.x)."""
    if not torch2:
        raise InvalidArgumentError(
            "cohort.torch.managed: backend 'nccl' needs torch 2.x (cohort.torch.nccl); on torch 1.13 use 'gloo'"
        )
    if not available():
        raise InvalidArgumentError(
            "cohort.torch.managed: backend 'nccl' needs a CUDA device and torch built with nccl, and this process "
            f"has {'no CUDA device' if not torch.cuda.is_available() else 'no nccl'} (cohort.torch.nccl); use "
            "'gloo', or the cohort backend (cohort.torch.init_process_group), which stages CUDA tensors through "
            "host memory"
        )


def prepare_environment() -> None:
    """Leaves nccl's failures to cohort: ``TORCH_NCCL_ASYNC_ERROR_HANDLING=0`` unless set."""
    os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "0")


def stream_marker() -> Any:
    """A CUDA event recorded now on the current stream: done once everything queued on it is."""
    event = torch.cuda.Event()
    event.record()
    return event


def create(store: Any, rank: int, size: int, seconds: float) -> Any:
    """torch's ``ProcessGroupNCCL`` for one generation, rendezvousing through ``store``."""
    options = dist.ProcessGroupNCCL.Options()
    options._timeout = datetime.timedelta(seconds=seconds)
    return dist.ProcessGroupNCCL(store, rank, size, options)


class DeviceWork(torch._C._distributed_c10d.Work):  # type: ignore[misc]
    """An nccl Work under the managed backend: ``wait()`` and ``get_future()`` are nccl's own
    (stream semantics kept), but a call of a failed generation raises its root cause."""

    def __init__(self, inner: Any, call: Any, generation: Any) -> None:
        super().__init__()
        self._inner = inner
        self._call = call
        self._gen = generation

    def wait(self, timeout: Any = None) -> bool:
        if self._gen.error is not None:
            raise self._gen.error
        try:
            ok = self._inner.wait() if timeout is None else self._inner.wait(timeout)
        except Exception as e:
            if self._gen.error is not None:
                raise self._gen.error from e
            first = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise self._gen.report(f"torch nccl: {self._call.name}: {first}") from e
        return bool(ok) if ok is not None else True

    def is_completed(self) -> bool:
        return bool(self._inner.is_completed())

    def get_future(self) -> Any:
        return self._inner.get_future()
