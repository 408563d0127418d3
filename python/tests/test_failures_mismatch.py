"""A mismatch's root cause over real processes: the rank that finds it reports it, and no rank's
"the peer closed its link" report may beat it to the coordinator."""

import json

ROUNDS = 4


def test_a_mismatch_is_the_root_cause_on_every_rank_in_every_round(coordinator_factory, spawn):
    """Rank 0 all-reduces while rank 1 broadcasts, in each of several generations: on both ranks
    the root cause is rank 1's mismatch, naming both calls, never "rank 1 failed: the peer
    closed its link" (rank 1 closed its links on finding the mismatch, so rank 0's report naming
    it could reach the coordinator first: 3 of 8 runs blamed the detector)."""
    coord = coordinator_factory(2)
    workers = [spawn(f"w{r}", "mismatch.py", coord.endpoint, "mismatch", f"w{r}", str(ROUNDS)) for r in range(2)]
    for w in workers:
        assert w.wait(timeout=120) == 0, w.output()
    for w in workers:
        reports = [json.loads(line) for line in w.output().splitlines() if line.startswith("{")]
        assert [r["round"] for r in reports] == list(range(ROUNDS)), w.output()
        for r in reports:
            assert "allreduce(" in r["reason"] and "broadcast(" in r["reason"], r
            assert "closed" not in r["reason"] and r["cause_rank"] is None, r
