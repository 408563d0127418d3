"""ElasticSampler: every sample of an epoch exactly once, whatever the re-formations."""

import numpy as np
import pytest

from cohort.sampler import ElasticSampler


def test_an_epoch_is_dealt_over_the_world_without_overlap():
    s = [ElasticSampler(100, seed=3) for _ in range(4)]
    for r, x in enumerate(s):
        x.reset(r, 4)
    parts = [x.indices() for x in s]
    assert all(len(p) == 25 for p in parts)
    assert sorted(np.concatenate(parts).tolist()) == list(range(100))


def test_remaining_samples_are_redealt_after_a_reformation():
    n, batch = 103, 4
    seen = []
    samplers = [ElasticSampler(n, seed=1, drop_last=False) for _ in range(3)]
    for r, x in enumerate(samplers):
        x.reset(r, 3)
    # Two steps at world 3, then a rank dies: the state (progress) of a survivor is synced.
    for _ in range(2):
        for x in samplers:
            seen.extend(x.indices()[:batch].tolist())
        for x in samplers:
            x.record_batch(0, batch)
    state = samplers[0].state_dict()
    survivors = [ElasticSampler(n, seed=1, drop_last=False) for _ in range(2)]
    for r, x in enumerate(survivors):
        x.load_state_dict(state)
        x.reset(r, 2)
    for x in survivors:
        seen.extend(x.indices().tolist())
    assert sorted(seen) == list(range(n)), "every sample exactly once"


def test_epochs_differ_and_replay_identically():
    a, b = ElasticSampler(50, seed=7), ElasticSampler(50, seed=7)
    a.set_epoch(2)
    b.set_epoch(2)
    assert a.indices().tolist() == b.indices().tolist()
    b.set_epoch(3)
    assert a.indices().tolist() != b.indices().tolist()
    with pytest.raises(ValueError):
        a.reset(4, 4)
    with pytest.raises(ValueError):
        a.load_state_dict({**b.state_dict(), "length": 51})
