"""Point-to-point and groups on the "cohort" torch.distributed backend (and point-to-point on
the managed gloo group), on real coordinator and
worker processes, under whichever torch runs the tests (1.13 or 2.x): receives posted before
their sends (a ring, a pair, across a collective, batch_isend_irecv), and new_group's ranks
outside the group."""

import re

import pytest
from conftest import import_torch

torch = import_torch()


@pytest.mark.parametrize(("world", "backend"), [(2, "cohort"), (3, "cohort"), (3, "managed")])
def test_receives_posted_before_their_sends_complete(world, backend, coordinator_factory, spawn):
    """``irecv`` then ``isend`` around a ring and in a pair, a receive posted across a
    collective, and ``batch_isend_irecv`` with the receive first: each completes with the sent
    data (they used to deadlock until the 10 s deadline revoked the generation, and
    ``batch_isend_irecv`` raised RecursionError on torch 2.x)."""
    coord = coordinator_factory(world)
    extra = ["managed"] if backend == "managed" else []
    workers = [spawn(f"w{r}", "torch_p2p.py", coord.endpoint, f"p2p-{world}", f"w{r}", *extra) for r in range(world)]
    for w in workers:
        assert w.wait(timeout=120) == 0, w.output()
    for w in workers:
        out = w.output()
        assert f"backend={'cohort_gloo' if backend == 'managed' else 'cohort'}" in out, out
        for name in (
            "ring irecv then isend 5",
            f"ring irecv then isend {1 << 20}",
            "irecv across a collective",
            "blocking send and recv",
            "batch_isend_irecv",
        ):
            assert f"ok {name}\n" in out, (name, out)
        assert re.search(r"^done \d+$", out, re.M), out
    # The pair is ranks 0 and 1, whichever processes the rendezvous made them.
    assert sum("ok pair irecv then isend 2" in w.output() for w in workers) == 2, [w.output() for w in workers]


def test_new_group_outside_its_ranks_raises_or_is_no_member(coordinator_factory, spawn):
    """``new_group([0, 1])`` at 3 ranks: on torch 1.13 every rank raises the documented error,
    the rank outside the group too (it used to wait in 1.13's store barrier for ranks that never
    counted); on torch 2.x the members all-reduce over it and rank 2 gets no group. Then
    ``new_group()`` over all ranks works on both."""
    coord = coordinator_factory(3)
    workers = [spawn(f"w{r}", "torch_new_group.py", coord.endpoint, "new-group", f"w{r}") for r in range(3)]
    for w in workers:
        assert w.wait(timeout=120) == 0, w.output()
    for w in workers:
        out = w.output()
        assert "ok whole-world new_group" in out and "done" in out, out
        if "torch=2." in out:
            assert "ok subgroup all_reduce" in out or "not a member: True" in out, out
        else:
            assert re.search(r"^refused: cohort backend: new_group .*needs torch 2\.x", out, re.M), out
