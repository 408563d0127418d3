"""The "cohort" torch.distributed backend on real coordinator and worker processes, on whichever
torch the interpreter has (the test command runs this file under Debian's torch 1.13 and under
PyPI's torch 2.x): every call against the locally computed answer, the calls cohort cannot run
raising errors that name them, and on torch 2.x no registration warning, a group name and a
DeviceMesh."""

import re

import pytest
from conftest import import_torch

torch = import_torch()


@pytest.mark.parametrize("world", [1, 2, 3])
def test_every_torch_distributed_call_matches_the_local_answer(world, coordinator_factory, spawn):
    coord = coordinator_factory(world)
    workers = [
        spawn(f"w{r}", "torch_backend.py", coord.endpoint, f"torch-backend-{world}", f"w{r}") for r in range(world)
    ]
    outputs = []
    for w in workers:
        assert w.wait(timeout=120) == 0, w.output()
        outputs.append(w.output())
    for out in outputs:
        assert re.search(r"^done \d+$", out, re.M), out
        assert "ok barrier" in out
        if world > 1:
            assert "ok send/recv" in out
            assert re.search(r"^unsupported send with a tag: .*tag 7", out, re.M), out
            assert re.search(r"^unsupported recv with a tag: .*tag 7", out, re.M), out
        if "torch=2." in out:
            for name in (
                "all_gather_into_tensor",
                "reduce_scatter_tensor",
                "all_gather_into_tensor coalesced",
                "reduce_scatter_tensor coalesced",
                "all_reduce_coalesced",
                "all_to_all_single",
                "all_to_all",
                "scatter",
                "device mesh",
            ):
                assert f"ok {name}" in out, (name, out)
    # Every rank ran the same checks, but rank 0 (whichever worker it is) has the root's extra ones.
    counts = sorted(int(re.search(r"^done (\d+)$", out, re.M).group(1)) for out in outputs)
    assert len(set(counts[:-1])) <= 1, counts
