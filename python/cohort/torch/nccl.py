"""``cohort.torch.nccl``: everything about nccl under :mod:`cohort.torch.managed`, and what was
and was not run.

**Not run: no command of this project has run nccl.** The development machine has no GPU, so
:func:`cohort.torch.managed.init_process_group` accepts only ``"gloo"``, and ``"nccl"`` raises
:func:`refuse`'s error instead of running code that no GPU has exercised. What a managed nccl
group needs beyond the gloo one, and where it would go (this module):

- **Creation** as for gloo: ``ProcessGroupNCCL(store, rank, size, options)`` through
  :class:`cohort.torch.Store` under the generation's scope, registered for the ``cuda`` device
  (gloo stays the group's CPU backend).
- **Abort**: nccl's kernels cannot be woken by shutting sockets down; the abort is torch's
  ``ProcessGroupNCCL.abort()`` (``ncclCommAbort`` beneath it), called by the generation's
  watchdog on revocation, with ``TORCH_NCCL_ASYNC_ERROR_HANDLING`` off so that torch's own
  watchdog does not end the process first, and ``ncclCommInitRankConfig`` with
  ``blocking=0`` (torch's ``TORCH_NCCL_USE_COMM_NONBLOCKING``) so that an abort during
  creation returns.
- **The watchdog bound**: a CUDA Work completes on the GPU stream, not on a host thread, so
  the bound is kept by a host timer per call (torchft's ``_WorkAcceleratorTimeout`` does the
  same), which reports a timeout through cohort and aborts.

Measured here: nothing on a GPU. The CPU path (gloo) is tested through kills:
``python/tests/test_managed.py``.
"""

from __future__ import annotations

from typing import NoReturn

from cohort.errors import InvalidArgumentError

__all__ = ["RUN", "NOT_RUN", "refuse"]

RUN: tuple[str, ...] = ()
"""What of nccl this project has run: nothing (no GPU on the machines that ran its tests)."""

NOT_RUN = (
    "ProcessGroupNCCL created per generation through cohort.torch.Store",
    "abort on revocation through ProcessGroupNCCL.abort() (ncclCommAbort)",
    "the watchdog's host-side bound on CUDA Works",
    "DDP, FSDP2 and cohort.hsdp on CUDA tensors through kills",
)
"""What a managed nccl group needs and no command here has run."""


def refuse() -> NoReturn:
    """Raises the error that says the managed nccl path was never run here."""
    raise InvalidArgumentError(
        "cohort.torch.managed: backend 'nccl' is not available: no GPU ran it in this project's tests "
        "(cohort.torch.nccl lists what it needs and what was not run); use 'gloo', or the cohort backend "
        "(cohort.torch.init_process_group) for CPU tensors"
    )
