"""Issue 49: what the Python package derives from a generation must not depend on
``Communicator.members``, which above the coordinator's ``--whole-answer-up-to`` lists only a
rank's known entries (its partners, its host-mates, the peers it links at set-up: with more
than 16 ranks on hosts of their own, a different part of the list on each rank). One process
holds 17 ranks (a thread each, a host name each; python/tests/workers/sparse_world.py), the
coordinator answers every generation above one member sparse, and every rank must agree on
HSDP's live replica groups and on torch's reconfigure verdicts (on torch 1.13 too: the
backend's hooks are called directly, as ``dist._reconfigure`` calls them)."""

import re

from conftest import import_torch

torch = import_torch()

GROUPS, SHARDS = 6, 3  # 17 ranks: the last group lacks a shard


def test_ranks_with_partial_member_lists_agree_on_live_groups_and_reconfigure(coordinator_factory, spawn):
    world = GROUPS * SHARDS - 1
    coord = coordinator_factory(world, world, "--whole-answer-up-to", "1")
    w = spawn("world", "sparse_world.py", coord.endpoint, "sparse-world", str(GROUPS), str(SHARDS))
    assert w.wait(timeout=180) == 0, w.output()
    out = w.output()
    assert re.search(rf"^ok {world}$", out, re.M), out
    views = [tuple(map(int, m.groups())) for m in re.finditer(r"^rank (\d+) known (\d+) of (\d+)$", out, re.M)]
    assert sorted(r for r, _, _ in views) == list(range(world)), out
    # The point of the test: every rank's member list is partial, and they differ.
    assert all(known < size == world for _, known, size in views), views
