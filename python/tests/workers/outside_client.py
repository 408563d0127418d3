"""What a client written from docs/python.md alone does, checked: the ``run`` snippet's
averager rebuilt on every (re)start, the sampler held by ``TorchState``, and a closed group's
communicator.

argv: COORDINATOR JOB WORKER_ID MODE. MODE:
- ``rebuild``: builds a GradientAverager twice for one model (as the doc's snippet does when
  ``run`` calls the function again): the first one must launch nothing afterwards, the second
  averages correctly; prints ``ok rebuild``.
- ``sampler``: ``TorchState(sampler=ElasticSampler(...))`` under ``run``: at the start the
  sampler must already be dealt over this generation; prints ``ok sampler rank=R size=N``.
- ``closed``: after ``group.close()`` the last communicator refuses a collective; prints
  ``ok closed: MESSAGE``.
"""

import sys

import torch

import cohort
import cohort.elastic
import cohort.sampler
import cohort.torch

coordinator, job, worker_id, mode = sys.argv[1:5]
group = cohort.Group(job, coordinator, worker_id, no_progress_timeout=20.0)

if mode == "rebuild":
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    state = cohort.elastic.TorchState(group, model=net, step=0)

    @cohort.elastic.run
    def train(state):
        first = cohort.torch.GradientAverager(net, state, bucket_bytes=256)
        averager = cohort.torch.GradientAverager(net, state, bucket_bytes=256)  # the rebuild
        x = torch.full((4, 8), float(state.rank + 1))
        net.zero_grad()
        net(x).sum().backward()
        launched = [b.work is not None for b in first._buckets]
        assert first._next_launch == 0 and not any(launched), "the replaced averager launched a bucket"
        assert not first.active and averager.active
        averager.synchronize()
        # Every rank's gradient is a function of its rank: the mean, computed here on the same model.
        torch.manual_seed(0)
        ref = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
        for r in range(state.size):
            ref(torch.full((4, 8), float(r + 1))).sum().backward()
        for p, q in zip(net.parameters(), ref.parameters()):
            assert torch.allclose(p.grad, q.grad / state.size), (p.grad, q.grad / state.size)

    train(state)
    print("ok rebuild", flush=True)
elif mode == "sampler":
    sampler = cohort.sampler.ElasticSampler(100, seed=3)
    state = cohort.elastic.TorchState(group, sampler=sampler, epoch=0)
    seen = {}

    @cohort.elastic.run
    def train(state):
        seen["rank"], seen["size"] = sampler.rank, sampler.size
        assert (sampler.rank, sampler.size) == (state.rank, state.size), (sampler.rank, sampler.size)
        return list(iter(sampler))

    mine = train(state)
    print(f"ok sampler rank={seen['rank']} size={seen['size']} first={mine[:3]}", flush=True)
elif mode == "closed":
    comm = group.next_generation()
    x = torch.ones(4)
    comm.allreduce(x)
    group.close()
    try:
        comm.allreduce(x)
    except cohort.InvalidArgumentError as e:
        print(f"ok closed: {e}", flush=True)
    else:
        raise AssertionError("the closed group's communicator ran a collective")
else:
    raise SystemExit(f"unknown mode {mode}")
