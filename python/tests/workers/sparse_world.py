"""Many ranks of one generation in one process (a thread each, a host name each), so that a
coordinator answering it as a sparse view (``--whole-answer-up-to`` below its size) gives every
rank a partial ``comm.members``; checks what must not depend on that list (issue 49).

argv: COORDINATOR JOB GROUPS SHARDS. Joins ``GROUPS * SHARDS - 1`` members ``wR.rI.sJ`` (replica
group I, shard J; the last group lacks its last shard, so it is incomplete) on hosts ``hR``.
Each rank, in its thread:

- ``cohort.hsdp.live_groups``: every group but the last is live, and where every rank is;
  then an allreduce over its shard subgroup cut from that answer (a rank cutting another
  subgroup than its peers would fail it);
- the torch backend's reconfigure hooks (``CohortBackend``, called as torch's
  ``dist._reconfigure`` calls them): the handle is the rank's worker id; the handles gathered
  in rank order bind the generation, as does their set; a stranger, the handles in another
  order, or ranks passing different handles raise ``InvalidArgumentError`` on every rank.

Prints ``rank R known K of N`` per rank, then ``ok RANKS`` (exit 0), or the failures (exit 1).
"""

import os
import sys
import threading
import traceback
from types import SimpleNamespace

import numpy as np

import cohort
import cohort.hsdp
from cohort.torch import CohortBackend

coordinator, job = sys.argv[1:3]
groups, shards = int(sys.argv[3]), int(sys.argv[4])
places = [(i, j) for i in range(groups) for j in range(shards)][:-1]
ID_BYTES = 32
errors: list[str] = []
lines: list[str] = []
lock = threading.Lock()


def must_raise(name: str, rank: int, fn, says: str) -> None:
    try:
        fn()
    except cohort.InvalidArgumentError as e:
        assert says in str(e), (name, str(e))
        return
    raise AssertionError(f"rank {rank}: {name} did not raise")


def run(index: int) -> None:
    replica, shard = places[index]
    worker_id = f"w{index}.r{replica}.s{shard}"
    group = cohort.Group(job, coordinator, worker_id, host=f"h{index}", no_progress_timeout=30.0)
    try:
        comm = group.next_generation()
        rank, size = comm.rank, comm.size
        known = len(comm.members)

        # HSDP's live groups and its shard subgroup.
        live, where = cohort.hsdp.live_groups(comm, replica, shard, shards)
        assert live == list(range(groups - 1)), (rank, live)
        assert where[replica][shard] == rank and sum(map(len, where.values())) == size, (rank, where)
        ranks = [where[i][shard] for i in live] if replica in live else [rank]
        if len(ranks) > 1:
            sub = comm.subgroup(ranks, 1)
            x = np.full(16, float(rank + 1))
            sub.allreduce(x)
            assert (x == sum(r + 1 for r in ranks)).all(), (rank, ranks, x[:2])

        # torch's reconfigure hooks: the handles in rank order, gathered without the member list.
        backend = CohortBackend(comm, rank, size)
        handle = backend.get_reconfigure_handle()
        assert handle == worker_id, (rank, handle)
        mine = np.zeros(ID_BYTES, dtype=np.uint8)
        mine[: len(handle)] = np.frombuffer(handle.encode(), dtype=np.uint8)
        every = np.zeros(ID_BYTES * size, dtype=np.uint8)
        comm.allgather(mine, every)
        handles = [bytes(b).rstrip(b"\0").decode() for b in every.reshape(size, ID_BYTES)]
        backend.reconfigure(SimpleNamespace(uuid=7, handles=handles)).wait()
        backend.reconfigure(SimpleNamespace(uuid=8, handles=set(handles))).wait()
        assert backend.reconfigured_uuid == 8
        must_raise(
            "a stranger", rank, lambda: backend.reconfigure(SimpleNamespace(uuid=9, handles=[*handles[:-1], "x"])), "x"
        )
        must_raise(
            "another order",
            rank,
            lambda: backend.reconfigure(SimpleNamespace(uuid=9, handles=handles[::-1])),
            "rank order",
        )
        # Every rank right about its own place, but rank 0 passes the set, the others the list.
        other = set(handles) if rank == 0 else handles
        must_raise(
            "different handles", rank, lambda: backend.reconfigure(SimpleNamespace(uuid=9, handles=other)), "different"
        )
        assert backend.reconfigured_uuid == 8
        with lock:
            lines.append(f"rank {rank} known {known} of {size}")
        comm.close()
        group.leave(finished=True)
    except BaseException:  # noqa: BLE001 - reported below, the process fails
        with lock:
            errors.append(f"{worker_id}: {traceback.format_exc()}")
        group.close()


threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(len(places))]
for t in threads:
    t.start()
for t in threads:
    t.join(timeout=120)
print("\n".join(sorted(lines, key=lambda s: int(s.split()[1]))), flush=True)
if errors or any(t.is_alive() for t in threads):
    print("\n".join(errors) or "a rank did not finish in 120 s", flush=True)
    os._exit(1)  # a rank's thread may still be blocked: do not wait for it
print(f"ok {len(places)}", flush=True)
