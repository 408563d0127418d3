"""An elastic sampler: each epoch's samples are dealt over the current world, and after a
re-formation the epoch's *remaining* samples are dealt over the new world (as Horovod's
``ElasticSampler`` does), so no sample of an epoch is lost or seen twice when ranks come and go.

It needs no torch: it yields indices into a data set of ``length`` samples, and is also a
valid ``torch.utils.data.Sampler`` (iterable, with ``__len__``). Keep it in the elastic state
(``TorchState(sampler=...)``) so that its progress is committed and synced with the model.
"""

from __future__ import annotations

from typing import Any, Iterator

import numpy as np

__all__ = ["ElasticSampler"]


class ElasticSampler:
    """Deals the indices ``0..length`` over the ranks, epoch by epoch.

    - ``set_epoch(e)``: a new seeded permutation (``seed``, ``e``), all samples unprocessed;
    - ``reset(rank, size)``: after a re-formation, deal the epoch's unprocessed samples over
      the new world (the permutation's order is kept, so every rank agrees);
    - ``record_batch(batch_index, batch_size)``: marks one step of the whole world as
      processed (``size * batch_size`` samples: the ranks step in lock step, and every rank
      records the same global progress, so the state agrees everywhere).

    Iterating yields this rank's share of the remaining samples: element ``k`` of the
    remaining order goes to rank ``k % size`` (a global batch of ``size * b`` consecutive
    remaining samples is split over the ranks). With ``drop_last`` (the default) every rank
    yields the same number of samples.
    """

    def __init__(self, length: int, *, shuffle: bool = True, seed: int = 0, drop_last: bool = True) -> None:
        if length < 0:
            raise ValueError("length must be non-negative")
        self.length = length
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.epoch = 0
        self.processed = 0
        self.rank = 0
        self.size = 1
        self._order = self._permutation()

    def _permutation(self) -> np.ndarray:
        if not self.shuffle:
            return np.arange(self.length, dtype=np.int64)
        return np.random.default_rng([self.seed, self.epoch]).permutation(self.length).astype(np.int64)

    def set_epoch(self, epoch: int) -> None:
        """Starts epoch ``epoch``: a fresh permutation, nothing processed."""
        self.epoch = epoch
        self.processed = 0
        self._order = self._permutation()

    def reset(self, rank: int, size: int) -> None:
        """Deals the rest of the epoch over a new world (call after every re-formation)."""
        if not 0 <= rank < size:
            raise ValueError(f"rank {rank} out of range for {size} ranks")
        self.rank, self.size = rank, size

    def record_batch(self, batch_index: int, batch_size: int) -> None:
        """Marks one step of the world as processed: ``size * batch_size`` samples (the
        batch index is accepted for Horovod compatibility; steps must be recorded in order)."""
        del batch_index
        self.processed = min(self.remaining_start + self.size * batch_size, self.length)

    def record_indices(self, count: int) -> None:
        """Marks ``count`` more samples (of the whole world) as processed."""
        self.processed = min(self.processed + count, self.length)

    @property
    def remaining_start(self) -> int:
        """Position in the epoch's order of the first unprocessed sample."""
        return self.processed

    def _remaining(self) -> np.ndarray:
        rest = self._order[self.processed :]
        if self.drop_last:
            rest = rest[: len(rest) - len(rest) % self.size]
        return rest

    def indices(self) -> np.ndarray:
        """This rank's share of the remaining samples, in order."""
        return self._remaining()[self.rank :: self.size]

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices().tolist())

    def __len__(self) -> int:
        return len(self.indices())

    def state_dict(self) -> dict[str, Any]:
        """Progress to commit (the world is not part of it: it is set by ``reset``)."""
        return {
            "epoch": self.epoch,
            "processed": self.processed,
            "length": self.length,
            "seed": self.seed,
            "shuffle": self.shuffle,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restores progress saved by :meth:`state_dict`."""
        if state["length"] != self.length:
            raise ValueError(f"sampler state is for {state['length']} samples, not {self.length}")
        self.seed, self.shuffle = state["seed"], state["shuffle"]
        self.epoch = state["epoch"]
        self._order = self._permutation()
        self.processed = state["processed"]
