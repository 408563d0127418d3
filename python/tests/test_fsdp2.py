"""FSDP2 (``fully_shard`` on a one-dimensional DeviceMesh) and HSDP (on a two-dimensional one:
replica groups of shard groups, subgroups of the generation on cohort) train to the same
parameters on the "cohort" backend, and HSDP on torch's gloo managed by cohort
(cohort.torch.managed: its DeviceMesh dimensions are managed gloo groups), as on gloo:
examples/pytorch/fsdp2.py, the same script, on real processes.
Needs torch 2.x (the test command runs it under PyPI's torch; Debian's 1.13 has no FSDP2)."""

import re
import sys
from pathlib import Path

from conftest import import_torch, torch2_only

torch = import_torch()
torch2_only(torch, "FSDP2", module=True)

EXAMPLE = str(Path(__file__).resolve().parents[2] / "examples" / "pytorch" / "fsdp2.py")
STEPS = ("--max-steps", "12")


def summaries(workers, timeout=240):
    out = []
    for w in workers:
        assert w.wait(timeout=timeout) == 0, w.output()
        m = w.wait_for_line(r"^event=summary .*$", timeout=5)
        out.append(dict(kv.split("=", 1) for kv in m.group(0).split()[1:]))
    return out


def gloo_then_cohort(coordinator_factory, spawn, tmp_path, world, job, *args, managed=False):
    """The example on gloo (file rendezvous), then on cohort (a coordinator of `world`), and with
    ``managed`` on torch's gloo managed by cohort (``--managed``: cohort.torch.managed), with the
    same `args`: (gloo's summaries, cohort's and the managed group's). One after the other, so
    that the runs do not share the cores."""
    gloo = [
        spawn(
            f"gloo-{r}",
            [sys.executable, "-u", EXAMPLE],
            "--gloo",
            str(tmp_path / "gloo-init"),
            "--rank",
            str(r),
            "--world",
            str(world),
            *args,
            *STEPS,
        )
        for r in range(world)
    ]
    reference = summaries(gloo)

    def on_coordinator(name, *flags):
        coord = coordinator_factory(world)
        return summaries(
            [
                spawn(
                    f"{name}-{r}",
                    [sys.executable, "-u", EXAMPLE],
                    "--coordinator",
                    coord.endpoint,
                    "--job",
                    f"{job}-{name}",
                    "--worker-id",
                    f"w{r}",
                    *flags,
                    *args,
                    *STEPS,
                )
                for r in range(world)
            ]
        )

    got = on_coordinator("cohort")
    assert {s["backend"] for s in got} == {"cohort"} and {s["backend"] for s in reference} == {"gloo"}
    if managed:
        on_managed = on_coordinator("managed", "--managed")
        assert {s["backend"] for s in on_managed} == {"cohort_gloo"}
        got += on_managed
    assert all(s["steps"] == "12" and s["world"] == str(world) for s in got + reference)
    return reference, got


def test_fully_shard_on_cohort_matches_gloo_at_two_ranks(coordinator_factory, spawn, tmp_path):
    reference, got = gloo_then_cohort(coordinator_factory, spawn, tmp_path, 2, "fsdp")
    # The full parameters, gathered from the shards, are bit-identical to gloo's on every rank:
    # at two ranks a sum (and its halving, for the average) does not depend on the order.
    assert len({s["param_sha256"] for s in got + reference}) == 1, (got, reference)
    assert re.fullmatch(r"[0-9a-f]{16}", got[0]["param_sha256"])


def test_hsdp_on_a_2d_mesh_on_cohort_and_managed_gloo_matches_gloo_at_four_ranks(coordinator_factory, spawn, tmp_path):
    """Two replica groups of two shards: the shard groups and the replica groups are cohort
    subgroups of one generation (each on its own channel over the generation's links), their
    collectives in flight at once. On the managed group (run here only: it covers FSDP2's
    calls at 2 ranks too) they are gloo groups made per mesh dimension (torch's
    ``new_group``) through the coordinator's store."""
    hsdp = ("--replicas", "2", "--hidden", "256")
    reference, got = gloo_then_cohort(coordinator_factory, spawn, tmp_path, 4, "hsdp", *hsdp, managed=True)
    assert {s["replicas"] for s in got + reference} == {"2"}
    # Every reduction combines two operands (two shards, then two replicas), so the order cannot
    # matter: bit-identical to gloo's on every rank.
    assert len({s["param_sha256"] for s in got + reference}) == 1, (got, reference)
