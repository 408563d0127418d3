"""A worker whose ranks call different collectives, generation after generation.

argv: COORDINATOR JOB WORKER_ID ROUNDS. In each of ROUNDS generations of two ranks, rank 0
all-reduces float32 while rank 1 broadcasts uint8 from rank 0: rank 1 finds the mismatch. Every
rank prints the failure it got as one JSON line (`{"round": ..., "cls": ..., "reason": ...}`),
then both re-form and go on. Prints `done` at the end.
"""

import json
import sys

import numpy as np

import cohort

coordinator, job, worker_id, rounds = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
group = cohort.Group(job, coordinator, worker_id, no_progress_timeout=20.0)
for n in range(rounds):
    comm = group.next_generation()
    try:
        if comm.rank == 0:
            comm.allreduce(np.ones(1000, dtype=np.float32))
        else:
            comm.broadcast(np.ones(1000, dtype=np.uint8), 0)
    except (cohort.CollectiveError, cohort.MismatchError) as e:
        # The detector raises MismatchError (not a CollectiveError), the other rank the
        # revocation; both carry the generation's root cause.
        cause = e.cause
        facts = dict(round=n, rank=comm.rank, cls=type(e).__name__, cause_rank=cause.rank, reason=cause.reason)
        print(json.dumps(facts), flush=True)
    else:
        raise AssertionError(f"round {n}: rank {comm.rank}'s call succeeded")
    comm.close()
print("done", flush=True)
group.leave(finished=True)
