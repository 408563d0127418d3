"""The findings of a client written from docs/python.md alone, each pinned on real coordinator
and worker processes: a GradientAverager rebuilt for the same model (the doc's ``run`` snippet
after a failure) launches no bucket twice, ``TorchState`` deals its sampler over the world, and
a closed group's communicator refuses work."""

import re

from conftest import import_torch


def run_mode(coordinator_factory, spawn, mode, world, timeout=120):
    coord = coordinator_factory(world)
    workers = [
        spawn(f"{mode}-w{r}", "outside_client.py", coord.endpoint, f"client-{mode}", f"w{r}", mode)
        for r in range(world)
    ]
    for w in workers:
        assert w.wait(timeout=timeout) == 0, w.output()
    return [w.output() for w in workers]


def test_a_rebuilt_gradient_averager_replaces_the_earlier_hooks(coordinator_factory, spawn):
    import_torch()
    for out in run_mode(coordinator_factory, spawn, "rebuild", 2):
        assert "ok rebuild" in out, out


def test_torch_state_deals_its_sampler_over_the_generation(coordinator_factory, spawn):
    import_torch()
    outs = run_mode(coordinator_factory, spawn, "sampler", 2)
    ranks = sorted(int(re.search(r"ok sampler rank=(\d+) size=2", out).group(1)) for out in outs)
    assert ranks == [0, 1], outs
    # Two ranks, two different shares of the epoch (not the same samples twice).
    firsts = {re.search(r"first=(\[.*\])", out).group(1) for out in outs}
    assert len(firsts) == 2, outs


def test_a_closed_groups_communicator_refuses_work(coordinator_factory, spawn):
    import_torch()
    (out,) = run_mode(coordinator_factory, spawn, "closed", 1)
    assert re.search(r"^ok closed: .*closed", out, re.M), out
