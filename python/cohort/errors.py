"""cohort's exceptions: every failure of the Rust layer reaches Python as one of these.

The hierarchy mirrors the crate's typed errors::

    CohortError
    ├── CollectiveError           a collective failed: this generation is unusable, re-form
    │   ├── PeerFailedError       a peer closed, reset or broke the protocol
    │   ├── TimeoutError          a no-progress (or whole-op) deadline passed (also a builtins.TimeoutError)
    │   ├── RevokedError          the generation was revoked (another rank's failure, a leave)
    │   └── TransportError        any other data-plane failure
    ├── JobEndedError             the job finished or failed (outcome, reason)
    ├── ExcludedError             the coordinator excluded this worker for longer than it waits
    ├── DivergedError             members hold different state for the same commit
    ├── ControlError              the coordinator was unreachable or refused a request
    ├── MismatchError             ranks called different collectives (also a ValueError); re-form
    └── InvalidArgumentError      bad arguments (also a ValueError); nothing was changed

    MembershipChanged             (not an error) the members agreed to re-form at a commit point
    GracefulLeave(SystemExit)     SIGTERM: this worker left the job gracefully; exit status 0

A ``CollectiveError`` from a communicator of a :class:`cohort.Group` carries the generation's
root cause as the coordinator recorded it: the rank that failed first, its worker id, host and
reason (``err.cause``, also as ``err.rank``, ``err.worker_id``, ``err.host``, ``err.reason``),
so that every rank names the real culprit, not a secondary "connection reset". ``err.peer`` is
the rank this rank itself saw fail, where there is one.
"""

from __future__ import annotations

import builtins
from dataclasses import dataclass
from typing import Optional

__all__ = [
    "RootCause",
    "CohortError",
    "CollectiveError",
    "PeerFailedError",
    "TimeoutError",
    "RevokedError",
    "TransportError",
    "JobEndedError",
    "ExcludedError",
    "DivergedError",
    "ControlError",
    "InvalidArgumentError",
    "MismatchError",
    "MembershipChanged",
    "GracefulLeave",
    "collective_failure",
]


@dataclass(frozen=True)
class RootCause:
    """Who or what made a generation fail, as the coordinator's revocation record names it."""

    rank: Optional[int]
    """The rank that failed first, when the failure is tied to one."""
    worker_id: str
    """Its worker id ("" when unknown)."""
    host: str
    """Its host ("" when unknown)."""
    reason: str
    """What happened: "SIGKILL", "lease expired", "peer rank 2 failed: ...", ..."""

    def __str__(self) -> str:
        parts = []
        if self.rank is not None:
            parts.append(f"rank {self.rank}")
        if self.worker_id and self.host:
            parts.append(f"(worker {self.worker_id} on {self.host})")
        elif self.worker_id:
            parts.append(f"(worker {self.worker_id})")
        elif self.host:
            parts.append(f"(on {self.host})")
        head = " ".join(parts)
        return f"{head}: {self.reason}" if head else self.reason


class CohortError(Exception):
    """Base class of cohort's errors. ``str(err)`` is the full message."""

    def __init__(self, message: str, **facts: object) -> None:
        super().__init__(message)
        self.message = message
        for key, value in facts.items():
            setattr(self, key, value)


class CollectiveError(CohortError):
    """A collective failed on this rank; the generation is unusable (every later call raises
    the same error). Restore the last commit and re-form (``cohort.elastic.run`` does).

    Attributes: ``generation``, ``cause`` (:class:`RootCause` or None), ``peer`` (the rank
    this rank saw fail, or None), and the cause's ``rank``, ``worker_id``, ``host``, ``reason``.
    """

    generation: int
    cause: Optional[RootCause]
    peer: Optional[int]

    def __init__(
        self,
        message: str,
        *,
        generation: int,
        cause: Optional[RootCause] = None,
        peer: Optional[int] = None,
        **facts: object,
    ) -> None:
        super().__init__(message, generation=generation, cause=cause, peer=peer, **facts)

    @property
    def rank(self) -> Optional[int]:
        """The root cause's rank (the rank that failed first), if known."""
        return self.cause.rank if self.cause else None

    @property
    def worker_id(self) -> str:
        """The root cause's worker id ("" if unknown)."""
        return self.cause.worker_id if self.cause else ""

    @property
    def host(self) -> str:
        """The root cause's host ("" if unknown)."""
        return self.cause.host if self.cause else ""

    @property
    def reason(self) -> str:
        """The root cause's reason (the local error's message if there is no cause)."""
        return self.cause.reason if self.cause else self.message


class PeerFailedError(CollectiveError):
    """A peer closed, reset or broke the protocol on its link (``peer`` names it)."""


class TimeoutError(CollectiveError, builtins.TimeoutError):
    """A deadline passed: the no-progress deadline on the link to ``peer``, or the whole-op
    bound (``peer`` is None then). ``after`` is the deadline in seconds."""

    after: float


class RevokedError(CollectiveError):
    """The generation was revoked: another rank failed or left, or this communicator was
    closed. ``cause`` says why."""


class TransportError(CollectiveError):
    """Any other data-plane failure (handshake, local I/O)."""


class JobEndedError(CohortError):
    """The job ended: ``outcome`` is "finished" or "failed", ``reason`` the coordinator's."""

    outcome: str
    reason: str


class ExcludedError(CohortError):
    """The coordinator excluded this worker (its failures repeated) for longer than it is
    willing to wait (``Group(exclusion_wait=...)``). ``retry_after``, ``waited`` and
    ``limit`` are in seconds."""

    retry_after: float
    waited: float
    limit: float


class DivergedError(CohortError):
    """Members hold different state for the same commit (their digests differ), or a
    snapshot could not be loaded. Never silently ignored."""


class ControlError(CohortError):
    """The coordinator could not be reached within the retry budget, or refused a request
    (``code`` is the gRPC status code name, e.g. "unauthenticated")."""

    code: str


class InvalidArgumentError(CohortError, ValueError):
    """The call was malformed (dtype, sizes, root, a non-contiguous tensor, a closed
    communicator), found on this rank before anything was sent. Nothing was changed."""


class MismatchError(CohortError, ValueError):
    """The ranks called different collectives, or the same one with different arguments: the
    message names both calls and what differs (collective, dtype, op, count, root or
    algorithm). A bug in the program, not a failure: it is not a ``CollectiveError``, so
    ``cohort.elastic.run`` does not retry it. Messages may have been exchanged already, so the
    communicator is unusable afterwards (every later call raises it again): re-form or build a
    new one. Attributes: ``generation``, ``peer`` (the rank whose message differed), ``cause``."""


class MembershipChanged(Exception):
    """Raised by ``State.commit()`` when the members agreed at this commit point to re-form
    (joiners are waiting, or a member is leaving). The state is committed; ``cohort.elastic.run``
    re-forms, syncs and calls the training function again, as Horovod's HostsUpdatedInterrupt."""


class GracefulLeave(SystemExit):
    """This worker received SIGTERM and left the job gracefully (at a commit point, or while
    joining). A ``SystemExit`` with status 0: uncaught, the process ends cleanly, as
    ``cohort-worker train`` does."""

    def __init__(self, message: str = "left the job gracefully (SIGTERM)") -> None:
        super().__init__(0)
        self.message = message

    def __str__(self) -> str:
        return self.message


_HANDED_ON: "list[CollectiveError]" = []
"""The last collective errors handed to code that re-raises them as its own (torch's futures)."""


def _handed_on(error: BaseException) -> None:
    """Records ``error`` as handed to torch, so that :func:`collective_failure` can find it
    behind the ``RuntimeError`` torch raises in its place (a few are kept: one per failure)."""
    if isinstance(error, CollectiveError):
        _HANDED_ON.append(error)
        del _HANDED_ON[:-8]


def collective_failure(error: BaseException) -> Optional[CollectiveError]:
    """The :class:`CollectiveError` behind ``error``: itself, one it was raised from, or one a
    torch future carried (torch raises a ``RuntimeError`` quoting it, from DDP's backward say).
    None when ``error`` is not a collective failure."""
    seen = 0
    e: Optional[BaseException] = error
    while e is not None and seen < 16:
        if isinstance(e, CollectiveError):
            return e
        e = e.__cause__ or e.__context__
        seen += 1
    text = str(error)
    for handed in reversed(_HANDED_ON):
        if f"{type(handed).__name__}: {handed}" in text:
            return handed
    return None
