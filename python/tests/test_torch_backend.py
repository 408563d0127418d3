"""The "cohort" torch.distributed backend on real coordinator and worker processes, on whichever
torch the interpreter has (the test command runs this file under Debian's torch 1.13 and under
PyPI's torch 2.x): every call against the locally computed answer, the calls cohort cannot run
raising errors that name them, and on torch 2.x no registration warning, a group name and a
DeviceMesh."""

import os
import re

import pytest
from conftest import import_torch, not_applicable, torch2_only

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
        if os.environ.get("COHORT_TORCH_AS_PROCESS_GROUP") == "1":
            assert "python_backend=False" in out, out  # the process-group form (torch 2.11's) ran
        assert "ok barrier" in out
        if world > 1:
            assert "ok send/recv" in out
            assert re.search(r"^unsupported send with a tag: .*tag 7", out, re.M), out
            assert re.search(r"^unsupported recv with a tag: .*tag 7", out, re.M), out
        if "torch=2." in out:
            for name in (
                "all_gather_into_tensor",
                "3000 async waits",
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
            # torch's reconfigure hooks, where this torch has them (2.15 does, 2.11 not).
            assert "ok all_reduce after reconfigure" in out or "ok reconfigure: not in this torch" in out, out
    # Every rank ran the same checks, but rank 0 (whichever worker it is) has the root's extra ones.
    counts = sorted(int(re.search(r"^done (\d+)$", out, re.M).group(1)) for out in outputs)
    assert len(set(counts[:-1])) <= 1, counts


def test_subgroup_channels_follow_torch_group_names_and_refuse_collisions(monkeypatch):
    """torch 2.x: a subgroup's channel comes from torch's group name (the same on every rank);
    two live groups on one channel that share two members (a link) are refused, disjoint or
    one-member overlaps are not."""
    import cohort.torch as ct

    torch2_only(torch, "subgroups (new_group over part of the world)")
    assert ct.TORCH2
    from types import SimpleNamespace

    # Channels 1 to 4094: 4095 is the point-to-point lanes' (P2P_CHANNEL).
    assert [ct.subgroup_channel(n) for n in ["0", "1", "5", "4093", "4094"]] == [1, 2, 6, 4094, 1]
    assert ct.P2P_CHANNEL == ct.MAX_CHANNEL + 1
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
    # "4099" wraps onto channel 6 too: with members 0 and 1 again it would share their link.
    with pytest.raises(RuntimeError, match="would share channel 6"):
        ct._create_extended(opts("4099", [2, 0, 1]), None)
    # So would the same ranks again.
    with pytest.raises(RuntimeError, match="would share channel 6"):
        ct._create_extended(opts("4099", [0, 1]), None)
    # Sharing only this rank shares no link: allowed, and every live group of the channel is
    # checked, not only the newest.
    other = ct._create_extended(opts("4099", [0, 3]), None)
    assert other._channel == 6 and other.rank() == 0
    with pytest.raises(RuntimeError, match=r"live group of ranks \[0, 1\]"):
        ct._create_extended(opts("8193", [0, 1, 4]), None)
    # A destroyed group frees its place on the channel.
    first.shutdown()
    assert [ref() for ref in ct._channels[6]] == [other]
    third = ct._create_extended(opts("8193", [0, 1, 4]), None)
    assert third._channel == 6
    # The whole world is the generation's own communicator, not a subgroup.
    whole = ct._create_extended(opts("7", list(range(6))), None)
    assert whole._members is None


def test_reconfigure_binds_the_world_to_a_replacement_generation(coordinator_factory, spawn):
    """torch's own fault-tolerance hook: after a rank is killed and a replacement joins, the
    survivor re-forms through cohort and ``dist._reconfigure`` binds the same torch group (no new
    process group) to the new generation; an all_reduce over it sums both ranks."""
    torch2_only(torch, "torch's reconfigure hooks (dist._reconfigure)")
    # torch 2.11 has no such hooks; from torch 2.15 (the test command's) a missing hook is a
    # failure, not a skip: docs/python.md documents it.
    version = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
    if version < (2, 15) and not hasattr(torch.distributed, "_reconfigure"):
        not_applicable(f"torch {torch.__version__} has no reconfigure hooks (dist._reconfigure)")
    assert hasattr(torch.distributed, "_reconfigure"), f"torch {torch.__version__} has no dist._reconfigure"
    coord = coordinator_factory(2)
    first = [spawn(f"w{r}", "reconfigure.py", coord.endpoint, "reconfigure", f"w{r}") for r in range(2)]
    ranks = [int(w.wait_for_line(r"^ready 1 (\d)$", timeout=120).group(1)) for w in first]
    # Rank 1 dies: survivors keep their order, so the survivor stays rank 0 (torch keeps ranks).
    survivor, victim = first if ranks == [0, 1] else first[::-1]
    victim.kill()
    spare = spawn("w2", "reconfigure.py", coord.endpoint, "reconfigure", "w2")
    for w in (survivor, spare):
        assert w.wait(timeout=120) == 0, w.output()
    # The survivor kept rank 0 of two, which torch's group needs; the spare is rank 1.
    assert re.search(r"^reconfigured 2 0$", survivor.output(), re.M), survivor.output()
    assert re.search(r"^reconfigured 2 1$", spare.output(), re.M), spare.output()


def test_a_failed_call_fails_its_work_and_its_future():
    """A failed collective's torch Work: ``wait()`` raises the cohort error (torch 2.x; torch's
    ``_create_work_from_future`` returned from ``wait()`` as if it had succeeded), and the future
    torch's C++ reads (DDP's reducer) fails in C++ quoting it, where a Python future's
    ``set_exception`` had handed C++ the exception object as the tensors (a segmentation fault).
    ``cohort.collective_failure`` finds the cohort error behind torch's RuntimeError."""
    from torch.futures import Future

    import cohort
    import cohort.torch as ct

    fut, outcome = Future(), ct._Outcome()
    work = ct._work(fut, outcome)
    assert not work.is_completed()
    outcome.error = cohort.PeerFailedError("peer rank 1 failed (test)", generation=1, peer=1)
    cohort.errors._handed_on(outcome.error)
    fut.set_result([torch.zeros(2)])
    assert work.is_completed()
    if ct.TORCH2:
        with pytest.raises(cohort.PeerFailedError, match="peer rank 1 failed"):
            work.wait()
    with pytest.raises(RuntimeError, match="PeerFailedError: peer rank 1 failed") as raised:
        work.get_future().wait()
    assert cohort.collective_failure(raised.value) is outcome.error
    assert cohort.collective_failure(RuntimeError("something else")) is None
    ok = ct._done([torch.ones(1)])
    assert ok.wait() and torch.equal(ok.get_future().wait()[0], torch.ones(1))
