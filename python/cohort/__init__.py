"""cohort: elastic, fault-tolerant collectives for data-parallel training, from Python.

A thin layer over the Rust crate ``cohort`` (no collective, rendezvous or failure logic is
written in Python):

- :class:`Group` joins an elastic job as a :class:`GroupConfig` says;
  :meth:`Group.next_generation` returns the :class:`Communicator` of the next generation
  (re-formation in one call);
- :class:`Communicator` runs collectives in place on NumPy arrays, buffers and CPU torch
  tensors, with the GIL released;
- :class:`Checkpoint` commits, restores and syncs state across re-formations;
- :mod:`cohort.errors` holds the exceptions, which carry the root cause of a failure;
- :mod:`cohort.elastic` (state, ``run``), :mod:`cohort.sampler` and :mod:`cohort.torch`
  (bucketed gradient averaging, the ``"cohort"`` torch.distributed backend) build on them.

torch is never imported by ``import cohort``.
"""

from cohort._native import Checkpoint, Communicator, Group, Member, SyncOutcome, Work, __version__, init_logging
from cohort.config import GroupConfig
from cohort.errors import *  # noqa: F401,F403
from cohort.errors import __all__ as _errors_all

__all__ = [
    "Group",
    "GroupConfig",
    "Communicator",
    "Checkpoint",
    "Member",
    "SyncOutcome",
    "Work",
    "init_logging",
    "__version__",
    *_errors_all,
]
