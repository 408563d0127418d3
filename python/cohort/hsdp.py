"""HSDP whose unit of failure is a replica group: torchft's model on cohort's control plane.

R replica groups of S ranks train one model. FSDP2 (``fully_shard``) shards it within each
replica group; after backward, shard ``j`` of the gradients is averaged across the groups.
When a rank dies, only its replica group stops: the other groups skip at most the step in
flight, re-form the cross-replica reduction without it and go on training. The failed group
re-forms with a replacement (a restarted pod, or a spare already waiting), takes the current
state from a live group, shard by shard and digest-checked, and rejoins at a step boundary.

::

    def build(mesh):                      # FSDP2 over the replica group's 1-D mesh
        net = make_model()
        for layer in net: fully_shard(layer, mesh=mesh)
        fully_shard(net, mesh=mesh)
        return net, torch.optim.SGD(net.parameters(), lr=0.05)

    def step(net, rows):                  # forward and backward on this rank's rows
        loss_fn(net(x[rows]), y[rows]).backward()

    trainer = cohort.hsdp.Trainer("job", coordinator, replica=i, worker_id="w7", build=build)
    trainer.run(step, batch=lambda s: global_batch_rows(s), steps=1000)
    ...                                    # trainer.model holds the trained shards
    trainer.leave()

Two kinds of job at the coordinator (no new RPC; configure them in its ``--config`` file):

- ``JOB.replica-I`` for each replica group I, with ``min_workers = max_workers = S``: its
  generation's communicator is the group's ``torch.distributed`` world (the ``"cohort"``
  backend), over which ``build`` shards the model. A failure revokes only this job.
- ``JOB.cross``, every rank of every replica group that trains (``min_workers = S``,
  ``max_workers = R*S``): one generation for all, so that every group sees the same set of
  live groups. Its worker ids are ``WORKER.rI.sJ``. At each formation every rank gathers
  each cross rank's replica and shard index (an allgather of 8 bytes a rank), so that all
  derive the same live groups whatever their view of the members (a generation above the
  coordinator's ``whole_answer_up_to`` gives each rank only its known entries); the shard
  subgroups (shard J of every complete group) are cut from its communicator
  (:meth:`cohort.Communicator.subgroup`).

Each step, on every rank: this rank's share of the step's global batch (the batch is split
over the live groups' ranks, so the global batch stays the same when a group is out),
forward and backward (FSDP2's collectives, in the replica group), then the sum of the
gradient shard over the shard subgroup divided by the live groups, and a 2-byte max over
the cross generation (joiners waiting, a rank leaving on SIGTERM). The replica group then
votes (a 3-byte max over its own communicator) whether every one of its cross-replica
calls succeeded: only then does it step the optimizer. (A commit, a snapshot of the shard:
parameters, optimizer state, step, is made only before a sync or before the model is dropped;
a skipped step changes nothing.) A failed cross-replica call (another group died) skips
the step on the whole group and re-forms the cross generation; the same batch is taken
again. Groups that disagree about the last step (one finished it before the revocation
reached it, another did not) are reconciled when the shard subgroups sync: the newest
commit wins (:meth:`cohort.Checkpoint.sync`, digests compared).

A failed call of the replica group itself (a rank of this group died or hung) is a replica
failure: the group's survivors leave the cross job at once (gracefully, so that the live
groups re-form without waiting for them and nothing is counted against them), rebuild the
model (``build`` again: ranks may move) and re-form the replica job, which waits for the
replacement. Then they join the cross job again, wait to be admitted at a step boundary,
and load their shard from a live group. A rank whose group is incomplete in a cross
generation (one of its members was not yet waiting when it formed) takes part only in the
2-byte max until the next formation.
"""

from __future__ import annotations

import io
import statistics
import sys
import time
from types import SimpleNamespace
from typing import Any, Callable, Optional

import numpy as np
import torch
import torch.distributed as dist

import cohort.torch as cohort_torch
from cohort._native import Checkpoint, Communicator, Group
from cohort.config import GroupConfig
from cohort.errors import (
    CohortError,
    CollectiveError,
    ControlError,
    GracefulLeave,
    JobEndedError,
    collective_failure,
)
from cohort.events import emit

__all__ = ["Trainer", "cross_worker_id", "live_groups", "replica_job", "CROSS_SUFFIX"]

CROSS_SUFFIX = ".cross"
"""The cross-replica job's id is the job's id with this suffix."""

SHARD_CHANNEL = 1
"""The channel of the shard subgroups (they are disjoint, so one channel serves all)."""

Build = Callable[[Any], "tuple[torch.nn.Module, torch.optim.Optimizer]"]
"""``build(mesh)``: the model, sharded with FSDP2 over ``mesh`` (the replica group's 1-D
``DeviceMesh``), and its optimizer."""

StepFn = Callable[[torch.nn.Module, Any], None]
"""``step(model, rows)``: forward and backward of this rank's share of the batch."""


def replica_job(job: str, replica: int) -> str:
    """The job id of replica group ``replica``."""
    return f"{job}.replica-{replica}"


def cross_worker_id(worker_id: str, replica: int, shard: int) -> str:
    """A worker's id in the cross-replica job: its replica group and shard index appended."""
    return f"{worker_id}.r{replica}.s{shard}"


class ReplicaStateLost(CohortError):
    """A replica group re-formed, but no live group holds the shard one of its new ranks needs
    (every replica group failed at once, or there is one): restart from a checkpoint."""


class Trainer:
    """One rank of HSDP over cohort, with its replica group as the unit of failure (module docs).

    Joins the replica group's job in the constructor (blocks until the coordinator answers).
    ``options`` are :class:`cohort.GroupConfig`'s keywords, used for both jobs. ``backend``
    is the replica group's ``torch.distributed`` world, over which FSDP2 runs: ``"cohort"``
    (the cohort backend, :func:`cohort.torch.init_process_group`) or ``"gloo"`` (torch's own
    gloo with cohort's membership, :func:`cohort.torch.managed.init_process_group`); the
    cross-replica reduction, the vote and the state's sync run on cohort's communicators
    either way.

    Attributes: ``step`` (steps taken), ``model`` and ``optimizer`` (from ``build``, rebuilt
    after a replica failure), ``comm`` (the replica group's communicator, the torch world),
    ``live_replicas`` (the replica groups that trained in the last cross generation),
    ``stats`` (counts and times, see :meth:`summary`).
    """

    def __init__(
        self,
        job: str,
        coordinator: Any,
        replica: int,
        worker_id: str,
        build: Build,
        *,
        idle_limit: float = 120.0,
        backend: str = "cohort",
        **options: Any,
    ) -> None:
        if replica < 0:
            raise ValueError("replica must be 0 or more")
        if backend not in ("cohort", "gloo"):
            raise ValueError(f'backend must be "cohort" or "gloo" (torch\'s gloo managed by cohort), not {backend!r}')
        self.backend = backend
        self.job = job
        self.replica = replica
        self.worker_id = worker_id
        self._coordinator = coordinator
        self._options = options
        self._build = build
        self._idle_limit = idle_limit
        self.step = 0
        self.comm: Optional[Communicator] = None
        self.model: Optional[torch.nn.Module] = None
        self.optimizer: Optional[torch.optim.Optimizer] = None
        self.live_replicas: list[int] = []
        self._shard_index: Optional[int] = None
        self._checkpoint = Checkpoint()
        self._params: list[torch.nn.Parameter] = []  # the sharded parameters, as built
        self._leaving = False  # this rank's SIGTERM was voted on: it leaves with its group
        self._state_valid = False  # the model holds the state of `step` (not a fresh build after it)
        self._cross_group: Optional[Group] = None
        self._cross: Optional[Communicator] = None
        self._shard: Optional[Communicator] = None
        self._training = False
        self._idle_since = 0.0
        self._step_done: list[float] = []  # wall-clock end of each completed step
        self._step_ms: list[float] = []
        self.outcome: Optional[str] = None  # what run() ended with ("trained", ...; see run)
        self.stats = {"replica_formations": 0, "cross_formations": 0, "skipped_steps": 0, "replica_failures": 0}
        self._replica_group = Group(GroupConfig(replica_job(job, replica), coordinator, worker_id, **options))
        self._replica_group.leave_at_commit_points()  # SIGTERM: the group leaves at a step boundary
        emit("joined", worker=worker_id, incarnation=self._replica_group.incarnation, addr=self._replica_group.address)

    # -- the loop ------------------------------------------------------------------------
    def run(self, step_fn: StepFn, batch: Callable[[int], Any], steps: int) -> bool:
        """Trains until ``steps`` steps are taken (``self.step``, the number of the next step,
        counts them): ``step_fn(model, share)`` with this rank's share of
        ``batch(step)`` (anything sliceable whose items are samples, a tensor of row indices
        say, split evenly over the live groups' ranks), then the cross-replica reduction, the
        vote and ``optimizer.step()``. Survives replica failures (its own group's: re-forms
        and heals; other groups': skips the step and re-forms the cross reduction).

        Returns True once trained, False when this worker did not finish the training
        (``self.outcome`` says why): ``"not-needed"``, a spare whose replica group finished
        without it (the job ended "finished" while it waited); ``"finished-without-this-group"``,
        a group that came back (or arrived) after every other group had finished and left the
        cross job: there is nobody to take the state from and the job's result is theirs, so
        the group leaves its replica job as finished (it says so on stderr) and trains no
        further. Raises
        :class:`cohort.JobEndedError` when a job fails (fewer than ``S`` workers for the
        elastic timeout), :class:`ReplicaStateLost`, :class:`cohort.GracefulLeave` on a rank
        that got SIGTERM (after its group left the cross job and it left its replica group),
        and any error of ``step_fn`` that is not a collective failure."""
        try:
            return self._run(step_fn, batch, steps)
        except GracefulLeave:
            # SIGTERM while waiting for a generation (of either job) left that job: leave the
            # replica job too, unless the step boundary's leave already did.
            try:
                self._replica_group.leave(finished=False)
            except CohortError:
                pass  # best effort: the leave raised below is what the caller acts on
            raise

    def _run(self, step_fn: StepFn, batch: Callable[[int], Any], steps: int) -> bool:
        while self.step < steps:
            if self.model is None:
                try:
                    self._form_replica()
                except JobEndedError as ended:
                    if ended.outcome == "finished" and self.stats["replica_formations"] == 0:
                        self._replica_group.leave(finished=True)
                        self.outcome = "not-needed"
                        return False
                    raise
            if self._cross is None:
                try:
                    self._form_cross()
                except CollectiveError as e:  # the group's barrier before joining: a member died
                    self._replica_failed(e)
                except (JobEndedError, ControlError) as e:
                    if not _cross_finished(e):
                        raise
                    self._finished_without_this_group(e)
                    return False
                continue
            if not self._training:
                self._idle_round()
                continue
            started = time.perf_counter()
            try:
                rows = self.share(batch(self.step))
                assert self.optimizer is not None
                self.optimizer.zero_grad()
                step_fn(self.model, rows)
            except Exception as e:  # noqa: BLE001 - classified: only collective failures are handled
                if collective_failure(e) is None:
                    raise
                self._replica_failed(e)
                continue
            self._finish_step(started)
        self.outcome = "trained"
        return True

    def _finished_without_this_group(self, ended: BaseException) -> None:
        """The cross job finished while this group was out: leave the replica job as finished."""
        message = (
            f"cohort.hsdp: replica group {self.replica} came back at step {self.step}, but the other replica groups "
            f"had finished the job ({ended}); this group stops here (the trained model is theirs)"
        )
        print(message, file=sys.stderr, flush=True)
        emit("leave", gen=0, step=self.step, extra={"replica": self.replica, "reason": "finished-without-this-group"})
        if self._cross_group is not None:
            self._cross_group.close()
            self._cross_group = None
        self._cross = self._shard = None
        self._training = False
        if dist.is_initialized():
            dist.destroy_process_group()
        self.model = self.optimizer = None
        self._replica_group.leave(finished=True)
        self.outcome = "finished-without-this-group"

    def share(self, rows: Any) -> Any:
        """This rank's contiguous slice of ``rows`` among every live group's ranks (group by
        group in replica order, each group's ranks in order)."""
        assert self.comm is not None and self._shard_index is not None
        parts = len(self.live_replicas) * self.comm.size
        k = self.live_replicas.index(self.replica) * self.comm.size + self._shard_index
        n = len(rows)
        return rows[k * n // parts : (k + 1) * n // parts]

    def leave(self) -> None:
        """Leaves both jobs as finished and closes the torch process group (call after
        :meth:`run`, once anything that still needs the group, say ``full_tensor()``, ran)."""
        if dist.is_initialized():
            dist.destroy_process_group()
        if self._cross_group is not None:
            self._cross_group.leave(finished=True)
            self._cross_group = None
        self._cross = self._shard = None
        self._replica_group.leave(finished=True)
        self.comm = None

    def summary(self) -> dict[str, object]:
        """What happened: steps, median step time, the longest gap between two completed steps
        (the longest stall this rank saw), and the formation, skip and failure counts."""
        gaps = [b - a for a, b in zip(self._step_done, self._step_done[1:])]
        return {
            "steps": self.step,
            "step_ms_median": f"{statistics.median(self._step_ms):.3f}" if self._step_ms else "0",
            "longest_gap_ms": f"{max(gaps) * 1e3:.1f}" if gaps else "0",
            **self.stats,
        }

    # -- the replica group -------------------------------------------------------------
    def _form_replica(self) -> None:
        """Re-forms the replica group (waits for a replacement after a failure), makes it the
        torch world and builds the model on its mesh."""
        from torch.distributed.device_mesh import init_device_mesh

        if self.comm is not None:
            self.comm.close()
            self.comm = None
        self.comm = self._replica_group.next_generation()
        if self.comm.rank != self._shard_index:
            self._checkpoint = Checkpoint()  # the commit held is another shard's: take this one from a live group
        self._shard_index = self.comm.rank
        if self.backend == "gloo":
            from cohort.torch import managed

            # The managed group needs the job's group (its store) beside the generation.
            managed.init_process_group(SimpleNamespace(group=self._replica_group, comm=self.comm))
        else:
            cohort_torch.init_process_group(self)
        mesh = init_device_mesh("cpu", (self.comm.size,))
        self.model, self.optimizer = self._build(mesh)
        # FSDP2 swaps unsharded tensors into the modules during forward and backward; these are
        # the sharded parameters, whose local data only the optimizer changes.
        self._params = list(self.model.parameters())
        self._state_valid = self.step == 0  # every group builds the same step-0 model
        self.stats["replica_formations"] += 1
        emit(
            "generation",
            gen=self.comm.generation,
            world=self.comm.size,
            rank=self.comm.rank,
            transport=self.comm.transport,
            extra={"job": "replica", "replica": self.replica},
        )

    def _replica_failed(self, error: BaseException) -> None:
        """This group cannot go on: leave the cross job at once (the live groups re-form without
        this group and count nothing against it), and drop the model (rebuilt at re-formation)."""
        self.stats["replica_failures"] += 1
        emit(
            "error",
            gen=self.comm.generation if self.comm else 0,
            rank=self.comm.rank if self.comm else 0,
            step=self.step,
            phase="replica",
            kind=type(error).__name__,
            cause=str(error).splitlines()[0] if str(error) else type(error).__name__,
        )
        self._leave_cross()
        self._drop_model()

    def _drop_model(self) -> None:
        """Commits the model's state (at ``step``: a failed step never reached the optimizer)
        and drops the model and the torch world; both are made anew at re-formation."""
        self._commit()
        if dist.is_initialized():
            dist.destroy_process_group()
        self.model = self.optimizer = None
        self._params = []
        self._state_valid = False

    def _commit(self) -> None:
        """Snapshots the shard as the commit of ``step``, unless it is one already or the model
        does not hold that step's state. Commits are made when they may be needed (before a
        sync, before the model is dropped), not every step: a skipped step changes nothing."""
        if self._state_valid and self.step > 0 and self._checkpoint.step != self.step:
            self._checkpoint.commit(self._save(), self.step)

    def _leave_cross(self) -> None:
        if self._cross_group is not None:
            self._cross_group.leave(finished=False)
            self._cross_group = None
        self._cross = self._shard = None
        self._training = False

    # -- the cross-replica generation ----------------------------------------------------
    def _form_cross(self) -> None:
        """Joins the cross job if this rank is not in it, waits for its next generation, cuts
        the shard subgroup and syncs this shard with the other live groups (newest commit)."""
        assert self.comm is not None and self._shard_index is not None
        if self._cross_group is None:
            # The whole group arrives together, so that a generation rarely holds part of it.
            self.comm.barrier()
            self._cross_group = Group(
                GroupConfig(
                    self.job + CROSS_SUFFIX,
                    self._coordinator,
                    cross_worker_id(self.worker_id, self.replica, self._shard_index),
                    **self._options,
                )
            )
            self._cross_group.leave_at_commit_points()
        while True:
            if self._cross is not None:
                self._cross.close()
            self._cross = self._shard = None
            self._cross = self._cross_group.next_generation()
            self.stats["cross_formations"] += 1
            try:
                self.live_replicas, groups = live_groups(self._cross, self.replica, self._shard_index, self.comm.size)
            except CollectiveError:
                continue
            self._training = self.replica in self.live_replicas
            emit(
                "generation",
                gen=self._cross.generation,
                world=self._cross.size,
                rank=self._cross.rank,
                transport=self._cross.transport,
                extra={
                    "job": "cross",
                    "replica": self.replica,
                    "live": ",".join(map(str, self.live_replicas)) or "-",
                    "step": self.step,
                },
            )
            if not self._training:
                self._idle_since = time.monotonic()
                return
            ranks = [groups[i][self._shard_index] for i in self.live_replicas]
            self._shard = self._cross.subgroup(ranks, SHARD_CHANNEL)
            self._commit()
            current = self._save() if self._checkpoint.step is None else b""  # used only if none committed
            try:
                snapshot, outcome = self._checkpoint.sync(self._shard, current)
            except CollectiveError:
                continue
            if outcome.step is None and self.step > 0:
                raise ReplicaStateLost(
                    f"replica group {self.replica} re-formed at step {self.step}, but no live replica group "
                    f"holds shard {self._shard_index}: restart the job from a checkpoint"
                )
            if outcome.changed or not self._state_valid:
                self._load(snapshot)
            return

    def _idle_round(self) -> None:
        """One round of a rank whose group is incomplete in this cross generation: the 2-byte
        max the training ranks run once per step, until they agree to re-form."""
        assert self._cross is not None and self._cross_group is not None
        if time.monotonic() - self._idle_since > self._idle_limit:
            self._replica_failed(
                TimeoutError(f"replica group {self.replica} stayed incomplete for {self._idle_limit:.0f} s")
            )
            return
        flags = np.array([self._cross_group.reformation_pending, False], dtype=np.uint8)
        try:
            if not self.live_replicas:
                time.sleep(0.002)  # nobody trains: poll at a gentle pace, not at the network's
            self._cross.allreduce(flags, "max")
        except CollectiveError:
            self._cross.close()
            self._cross = None
            return
        if flags.any():
            self._cross.close()
            self._cross = None

    # -- one step's end ------------------------------------------------------------------
    def _finish_step(self, started: float) -> None:
        """The cross-replica reduction, the group's vote, and the optimizer's step if it passed."""
        assert self.model is not None and self.optimizer is not None and self.comm is not None
        assert self._cross is not None and self._shard is not None and self._cross_group is not None
        grads = []
        for p in self.model.parameters():
            local = _local(p)
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            grads.append(_local(p.grad))
            assert grads[-1].shape == local.shape
        flat = torch.cat([g.reshape(-1) for g in grads]) if grads else torch.zeros(0)
        # Read once: the cross generation and this group's vote must hear the same answer.
        leaving = self._replica_group.leaving
        flags = np.array([self._cross_group.reformation_pending, leaving], dtype=np.uint8)
        cross_ok = True
        try:
            if len(self.live_replicas) > 1:
                self._shard.allreduce(flat, "sum")
            self._cross.allreduce(flags, "max")
        except CollectiveError:
            cross_ok = False
        # The group's vote: a failed cross-replica call anywhere in it; a re-formation of the
        # cross generation that every live group agreed on (joiners, or some group leaving);
        # a rank of this very group leaving.
        vote = np.array([0 if cross_ok else 1, flags.any(), leaving], dtype=np.uint8)
        try:
            self.comm.allreduce(vote, "max")
        except CollectiveError as e:
            self._replica_failed(e)
            return
        if vote[0] == 0:
            if len(self.live_replicas) > 1:
                flat /= len(self.live_replicas)
                offset = 0
                with torch.no_grad():
                    for g in grads:
                        g.copy_(flat[offset : offset + g.numel()].view_as(g))
                        offset += g.numel()
            self.optimizer.step()
            self.step += 1
            now = time.perf_counter()
            self._step_ms.append((now - started) * 1e3)
            self._step_done.append(time.time())
            emit(
                "step",
                gen=self._cross.generation,
                world=self._cross.size,
                rank=self.comm.rank,
                step=self.step,
                ms=f"{(now - started) * 1e3:.3f}",
                extra={"replica": self.replica, "replicas": len(self.live_replicas)},
            )
        else:
            self.stats["skipped_steps"] += 1
        if vote[2]:
            self._leaving = bool(leaving)
            self._group_leaves()
        elif vote.any():
            self._cross.close()
            self._cross = None

    def _group_leaves(self) -> None:
        """A rank of this group got SIGTERM: the group leaves the cross job at this step
        boundary (no failure anywhere); the leaver leaves its replica job and exits, the others
        wait for its replacement."""
        self._leave_cross()
        self._drop_model()
        if self._leaving:
            assert self.comm is not None
            gen, rank = self.comm.generation, self.comm.rank
            emit("leave", gen=gen, rank=rank, step=self.step, extra={"replica": self.replica})
            self._replica_group.leave(finished=False)
            raise GracefulLeave(f"left replica group {self.replica} at step {self.step} (SIGTERM)")

    # -- the shard's state -------------------------------------------------------------
    def _save(self) -> bytes:
        """This rank's shard as bytes: the step, the local parameters and buffers, the
        optimizer's per-parameter state (local) and its hyper-parameters."""
        assert self.model is not None and self.optimizer is not None
        params = self._params
        state = {
            "step": self.step,
            "params": [_local(p).detach().clone() for p in params],
            "buffers": [b.detach().clone() for b in self.model.buffers()],
            "optim": [{k: _saved(v) for k, v in self.optimizer.state.get(p, {}).items()} for p in params],
            "groups": [{k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups],
        }
        buf = io.BytesIO()
        torch.save(state, buf)
        return buf.getvalue()

    def _load(self, snapshot: bytes) -> None:
        assert self.model is not None and self.optimizer is not None
        state = torch.load(io.BytesIO(snapshot))
        params = self._params
        if len(state["params"]) != len(params) or len(state["optim"]) != len(params):
            raise ValueError(f"a snapshot of {len(state['params'])} parameters, but the model has {len(params)}")
        with torch.no_grad():
            for p, t in zip(params, state["params"]):
                _local(p).copy_(t)
            for b, t in zip(self.model.buffers(), state["buffers"]):
                b.copy_(t)
        for p, saved in zip(params, state["optim"]):
            self.optimizer.state[p] = {k: _like_param(v, p) for k, v in saved.items()}
        for group, saved in zip(self.optimizer.param_groups, state["groups"]):
            group.update(saved)
        self.step = state["step"]
        self._state_valid = True


def live_groups(
    cross: Communicator, replica: int, shard: int, group_size: int
) -> tuple[list[int], dict[int, dict[int, int]]]:
    """The replica groups complete in the cross generation ``cross`` (every shard ``0..group_size``
    present), ascending, and where every rank of it is (``{replica: {shard: cross rank}}``); this
    rank is shard ``shard`` of group ``replica``. The same on every rank: each rank's (replica,
    shard) is gathered over ``cross`` (an allgather of 8 bytes a rank), not read from
    ``cross.members``, which in a generation above the coordinator's ``whole_answer_up_to``
    lists only this rank's known entries (a different few on each rank). Collective: raises a
    collective error when a rank fails meanwhile (re-form and call again)."""
    mine = np.array([replica, shard], dtype=np.int32)
    every = np.zeros(2 * cross.size, dtype=np.int32)
    cross.allgather(mine, every)
    groups: dict[int, dict[int, int]] = {}
    for rank, (r, s) in enumerate(every.reshape(-1, 2).tolist()):
        groups.setdefault(r, {})[s] = rank
    live = sorted(i for i, shards in groups.items() if sorted(shards) == list(range(group_size)))
    return live, groups


def _cross_finished(error: BaseException) -> bool:
    """Whether ``error`` says that the cross job finished: waiting for its generation
    (``JobEndedError``), or refused at the join (the coordinator's "has ended (Finished: ...)")."""
    if isinstance(error, JobEndedError):
        return error.outcome == "finished"
    return isinstance(error, ControlError) and "has ended (Finished" in str(error)


def _local(t: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor (the tensor itself otherwise)."""
    return t.to_local() if hasattr(t, "to_local") else t


def _saved(value: Any) -> Any:
    """An optimizer value as a snapshot holds it: a tensor's local shard, copied."""
    return _local(value).detach().clone() if torch.is_tensor(value) else value


def _like_param(value: Any, p: torch.Tensor) -> Any:
    """A saved optimizer value as the optimizer holds it: a tensor shaped like the parameter's
    local shard becomes a DTensor sharded as the parameter is."""
    if not torch.is_tensor(value) or not hasattr(p, "to_local") or value.dim() == 0:
        return value
    if value.shape != p.to_local().shape:
        return value
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(value, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride())
