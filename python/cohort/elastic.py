"""Elastic training in the manner of Horovod Elastic and torchft: a state, commits, and a
``run`` wrapper that survives failures and membership changes.

::

    group = cohort.Group(cohort.GroupConfig("job", "http://coordinator:7470"))
    state = cohort.elastic.TorchState(group, model=model, optimizer=opt, epoch=0, batch=0)

    @cohort.elastic.run
    def train(state):
        for state.epoch in range(state.epoch, epochs):
            for ...:
                loss.backward(); averager.synchronize(); opt.step()
                state.batch += 1
                state.commit()          # a commit point: may raise MembershipChanged

    train(state)

Everything here is bookkeeping around the Rust crate: the rendezvous and mesh
(``Group.next_generation``), the failure report and root cause (the collectives' exceptions),
and the commit/restore/sync with digests (``Checkpoint``) are cohort's; no collective or
failure logic is written in Python.

- ``state.commit()`` snapshots the state as the next commit, reports it to the coordinator,
  and agrees with every rank (one tiny allreduce) whether to re-form here: joiners are waiting,
  or a rank is leaving on SIGTERM. Then it raises :class:`cohort.MembershipChanged` (the state
  is committed; nothing is lost), or for the leaving rank leaves the job and raises
  :class:`cohort.GracefulLeave` (a ``SystemExit`` with status 0).
- :func:`run` calls the training function; on a :class:`cohort.CollectiveError` (a peer died,
  hung, or the generation was revoked) it restores the last commit, re-forms, syncs and calls
  it again; on ``MembershipChanged`` it re-forms and syncs without restoring. After every
  re-formation the reset callbacks run (rescale the learning rate, re-shard the data).
- ``sync()`` makes every member hold the newest commit any member has (joiners receive it);
  members that claim the same commit with different state raise :class:`cohort.DivergedError`.
"""

from __future__ import annotations

import functools
import io
import pickle
from typing import Any, Callable, Optional, TypeVar

from cohort._native import Checkpoint, Communicator, Group
from cohort.errors import CollectiveError, GracefulLeave, JobEndedError, MembershipChanged, collective_failure

__all__ = ["State", "ObjectState", "TorchState", "run"]

F = TypeVar("F", bound=Callable[..., Any])


class State:
    """What a training function keeps across failures; subclasses say how to save and load it.

    Attributes: ``group`` (the :class:`cohort.Group`), ``comm`` (the current
    :class:`cohort.Communicator`, None before the first re-formation), ``checkpoint``.
    """

    def __init__(self, group: Group) -> None:
        self.group = group
        # SIGTERM is this state's business: commit() leaves at the next commit point.
        group.leave_at_commit_points()
        self.comm: Optional[Communicator] = None
        self.checkpoint = Checkpoint()
        # The last agreed commit (snapshot, step), to roll back to when an agreement fails.
        self._last_commit: Optional[tuple[bytes, int]] = None
        self._reset_callbacks: list[Callable[[], None]] = []
        self._failure_callbacks: list[Callable[[CollectiveError], None]] = []
        self.reformations = 0

    # -- what subclasses provide ---------------------------------------------------------
    def save(self) -> bytes:
        """The state as bytes (deterministic: equal states give equal bytes)."""
        raise NotImplementedError

    def load(self, snapshot: bytes) -> None:
        """Replaces the state with a snapshot made by :meth:`save`."""
        raise NotImplementedError

    # -- the generation -------------------------------------------------------------------
    @property
    def rank(self) -> int:
        """This rank in the current generation."""
        return self._comm().rank

    @property
    def size(self) -> int:
        """The current world size."""
        return self._comm().size

    @property
    def generation(self) -> int:
        """The current generation number."""
        return self._comm().generation

    def _comm(self) -> Communicator:
        if self.comm is None:
            raise RuntimeError("no generation yet: call the training function through cohort.elastic.run, or reform()")
        return self.comm

    def register_reset_callbacks(self, callbacks: list[Callable[[], None]]) -> None:
        """Functions called after every re-formation (new world size, new rank)."""
        self._reset_callbacks.extend(callbacks)

    def register_failure_callbacks(self, callbacks: list[Callable[[CollectiveError], None]]) -> None:
        """Functions called with each collective failure that ``run`` recovers from (the
        exception carries the root cause), before the restore."""
        self._failure_callbacks.extend(callbacks)

    def _reformed(self) -> None:
        """Runs after every re-formation and sync, before the reset callbacks (subclasses
        re-deal what depends on the world: :class:`TorchState` resets its sampler)."""

    # -- commit, restore, sync ------------------------------------------------------------
    def commit(self, step: Optional[int] = None) -> None:
        """A commit point: snapshot the state, report it, and agree on re-forming here.

        ``step`` defaults to the next commit number (the last one plus one).
        Raises :class:`MembershipChanged` (after committing) when the members agreed to
        re-form, :class:`GracefulLeave` on the rank that got SIGTERM (after leaving the job),
        a :class:`CollectiveError` if a peer failed during the agreement, and
        :class:`DivergedError` on every rank if the members committed different steps or
        different state. In both cases the commit was not agreed and is not kept: this rank's
        checkpoint is rolled back to the last agreed commit (as the Rust ``Checkpoint::agree``
        does).
        """
        comm = self._comm()
        if step is None:
            step = (self.checkpoint.step or 0) + 1
        snapshot = self.save()
        previous = self._last_commit
        self.checkpoint.commit(snapshot, step)
        try:
            pending = self.group.commit(comm.generation, step, self.checkpoint.digest)
            leaving = self.group.leaving
            # One small allreduce: the flags, and (in-band) the check that every member
            # committed this step with the same state; DivergedError on every rank if not.
            flags = self.checkpoint.agree(comm, bytes([pending, leaving]))
        except CollectiveError:
            # Not agreed, so not a commit: a step whose collective failed may have reached the
            # optimizer with a partial result, and restore() must not load it. Members that
            # did agree keep it, and the next sync hands it to the others (newest wins).
            # Checkpoint.agree has rolled back already when it raised; this also covers a
            # failure before it.
            if previous is None:
                self.checkpoint = Checkpoint()
            else:
                self.checkpoint.commit(*previous)
            raise
        self._last_commit = (snapshot, step)
        if flags[1] and leaving:
            comm.close()
            self.comm = None
            self.group.leave(finished=False)
            raise GracefulLeave(f"left the job at commit {step} (SIGTERM)")
        if flags[0] or flags[1]:
            raise MembershipChanged("leave" if flags[1] else "joiners waiting")

    def restore(self) -> None:
        """Loads the last commit (after a failed step). Before any commit: nothing to do."""
        if self.checkpoint.step is not None:
            self.load(self.checkpoint.snapshot())

    def sync(self) -> None:
        """Makes every member hold the newest commit (digests compared) and loads it."""
        snapshot, outcome = self.checkpoint.sync(self._comm(), self.save())
        self._last_commit = None if outcome.step is None else (snapshot, outcome.step)
        self.load(snapshot)

    def reform(self) -> None:
        """Re-forms into the next generation (closing the current communicator), syncs the
        state and runs the reset callbacks. Retries while the new generation fails during
        the sync; raises :class:`JobEndedError` when the job has ended."""
        while True:
            if self.comm is not None:
                self.comm.close()
                self.comm = None
            self.comm = self.group.next_generation()
            try:
                self.sync()
            except CollectiveError:
                self.restore()
                continue
            break
        self.reformations += 1
        self._reformed()
        for callback in self._reset_callbacks:
            callback()


class ObjectState(State):
    """User values (epoch, batch, anything picklable) as attributes::

    state = ObjectState(group, epoch=0, batch=0)
    state.epoch += 1
    """

    def __init__(self, group: Group, **values: Any) -> None:
        super().__init__(group)
        self._keys = sorted(values)
        for key, value in values.items():
            setattr(self, key, value)

    def _values(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self._keys}

    def save(self) -> bytes:
        return pickle.dumps(self._values(), protocol=4)

    def load(self, snapshot: bytes) -> None:
        for key, value in pickle.loads(snapshot).items():
            setattr(self, key, value)


class TorchState(ObjectState):
    """A model's and an optimizer's ``state_dict`` plus user values (and a sampler's state)::

        state = TorchState(group, model=net, optimizer=opt, sampler=sampler, epoch=0)

    The model and optimizer are saved with ``torch.save`` into memory and loaded in place.
    After every re-formation (the first one, when training starts, included) the sampler is
    reset to the new world, ``sampler.reset(rank, size)``, before the reset callbacks run.
    """

    def __init__(
        self, group: Group, model: Any = None, optimizer: Any = None, sampler: Any = None, **values: Any
    ) -> None:
        super().__init__(group, **values)
        self.model = model
        self.optimizer = optimizer
        self.sampler = sampler

    def _reformed(self) -> None:
        if self.sampler is not None and hasattr(self.sampler, "reset"):
            self.sampler.reset(self.rank, self.size)

    def save(self) -> bytes:
        import torch

        parts = {"values": self._values()}
        if self.model is not None:
            parts["model"] = self.model.state_dict()
        if self.optimizer is not None:
            parts["optimizer"] = self.optimizer.state_dict()
        if self.sampler is not None:
            parts["sampler"] = self.sampler.state_dict()
        buf = io.BytesIO()
        torch.save(parts, buf)
        return buf.getvalue()

    def load(self, snapshot: bytes) -> None:
        import torch

        parts = torch.load(io.BytesIO(snapshot))
        for key, value in parts["values"].items():
            setattr(self, key, value)
        if self.model is not None and "model" in parts:
            self.model.load_state_dict(parts["model"])
        if self.optimizer is not None and "optimizer" in parts:
            self.optimizer.load_state_dict(parts["optimizer"])
        if self.sampler is not None and "sampler" in parts:
            self.sampler.load_state_dict(parts["sampler"])


def run(func: F) -> F:
    """Runs ``func(state, *args, **kwargs)`` elastically (see the module docs).

    The first call re-forms (joins the first generation) and syncs: every member starts
    from the state of the lowest rank (or the newest commit). When ``func`` returns, the
    worker leaves the job as finished and its return value is returned. When the job ends
    while re-forming (the others finished), returns None.
    """

    @functools.wraps(func)
    def wrapper(state: State, *args: Any, **kwargs: Any) -> Any:
        while _reform_unless_finished(state):
            try:
                result = func(state, *args, **kwargs)
            except MembershipChanged:
                pass
            except Exception as error:  # noqa: BLE001 - only collective failures are handled
                # torch re-raises a failed collective as its own RuntimeError (DDP's backward).
                failure = collective_failure(error)
                if failure is None:
                    raise
                for callback in state._failure_callbacks:
                    callback(failure)
                state.restore()
            else:
                if state.comm is not None:
                    state.comm.close()
                    state.comm = None
                state.group.leave(finished=True)
                return result
        return None

    return wrapper  # type: ignore[return-value]


def _reform_unless_finished(state: State) -> bool:
    """Re-forms; False when the job has finished meanwhile (the others completed it)."""
    try:
        state.reform()
    except JobEndedError as e:
        if e.outcome == "finished":
            return False
        raise
    return True
