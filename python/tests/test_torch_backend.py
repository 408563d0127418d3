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


def test_subgroup_channels_follow_torch_group_names_and_refuse_collisions(monkeypatch):
    """torch 2.x: a subgroup's channel comes from torch's group name (the same on every rank);
    two live groups on one channel that share two members (a link) are refused, disjoint or
    one-member overlaps are not."""
    import cohort.torch as ct

    if not ct.TORCH2:
        pytest.skip(f"subgroups need torch 2.x (this is {torch.__version__})")
    from types import SimpleNamespace

    assert [ct.subgroup_channel(n) for n in ["0", "1", "5", "4094", "4095"]] == [1, 2, 6, 4095, 1]
    hashed = ct.subgroup_channel("3f786850e387550fdab836ed7e6dc881de23001b")
    assert 1 <= hashed <= ct.MAX_CHANNEL and hashed == ct.subgroup_channel("3f786850e387550fdab836ed7e6dc881de23001b")

    monkeypatch.setattr(ct, "_pending_source", SimpleNamespace(comm=SimpleNamespace(rank=0, size=6)))
    monkeypatch.setattr(ct, "_channels", {})

    def opts(name, ranks):
        return SimpleNamespace(
            group_id=name,
            global_ranks_in_group=ranks,
            group_rank=ranks.index(0),
            group_size=len(ranks),
            store=None,
            timeout=None,
        )

    first = ct._create_extended(opts("5", [0, 1]), None)
    assert (first._members, first._channel, first.rank(), first.size()) == ([0, 1], 6, 0, 2)
    # "4100" wraps onto channel 6 too: with members 0 and 1 again it would share their link.
    with pytest.raises(RuntimeError, match="would share channel 6"):
        ct._create_extended(opts("4100", [2, 0, 1]), None)
    # So would the same ranks again.
    with pytest.raises(RuntimeError, match="would share channel 6"):
        ct._create_extended(opts("4100", [0, 1]), None)
    # Sharing only this rank shares no link: allowed, and every live group of the channel is
    # checked, not only the newest.
    other = ct._create_extended(opts("4100", [0, 3]), None)
    assert other._channel == 6 and other.rank() == 0
    with pytest.raises(RuntimeError, match=r"live group of ranks \[0, 1\]"):
        ct._create_extended(opts("8195", [0, 1, 4]), None)
    # A destroyed group frees its place on the channel.
    first.shutdown()
    assert [ref() for ref in ct._channels[6]] == [other]
    third = ct._create_extended(opts("8195", [0, 1, 4]), None)
    assert third._channel == 6
    # The whole world is the generation's own communicator, not a subgroup.
    whole = ct._create_extended(opts("7", list(range(6))), None)
    assert whole._members is None
