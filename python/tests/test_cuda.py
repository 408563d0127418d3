"""GPU checks (issue 50), run where a CUDA device is (scripts/device-check.sh), not applicable
elsewhere: the cohort backend on CUDA tensors with 2 and 4 processes sharing the GPU (values
checked, DDP's parameters equal on every rank, the time beside host tensors printed), and the
managed backend with nccl at world size 1, abort included."""

import json

import pytest
from conftest import import_torch, not_applicable, torch2_only

torch = import_torch()
torch2_only(torch, "the CUDA checks", module=True)
if not torch.cuda.is_available():
    not_applicable("needs a CUDA device (scripts/device-check.sh runs this where one is)", module=True)


def events(worker, kind):
    lines = worker.output().splitlines()
    return [e for e in (json.loads(line) for line in lines if line.startswith("{")) if e["event"] == kind]


@pytest.mark.parametrize("ranks", [1, 2, 4])
def test_cohort_backend_on_cuda_tensors(coordinator_factory, spawn, ranks):
    coord = coordinator_factory(ranks, ranks)
    workers = [
        spawn(f"cuda-{ranks}-{i}", "cuda_collectives.py", coord.endpoint, f"cuda-{ranks}", f"w{i}")
        for i in range(ranks)
    ]
    for w in workers:
        assert w.wait(timeout=420) == 0, w.output()
    for w in workers:
        out = w.output()
        assert out.count("ok all_reduce ") == 6, out
        assert "ok broadcast" in out and "ok all_gather list" in out, out
        assert "ok all_gather on CUDA refused" in out, out
        assert out.rstrip().endswith("done"), out
        # The largest float32 tensor crossed in several chunks.
        assert "n=3000001 chunks=3" in out, out
    digests = {e["param_sha256"] for w in workers for e in events(w, "ddp")}
    assert len(digests) == 1, digests
    for e in events(workers[0], "timing"):
        print(json.dumps(e))  # collected by scripts/device-check.sh


def test_managed_nccl_at_world_size_one(coordinator_factory, spawn):
    coord = coordinator_factory(1, 1)
    w = spawn("managed-nccl", "managed_nccl.py", coord.endpoint, "managed-nccl")
    assert w.wait(timeout=180) == 0, w.output()
    out = w.output()
    assert "ok nccl all_reduce broadcast, gloo all_reduce" in out, out
    assert "ok the watchdog saw every nccl call complete" in out, out
    assert "ok aborted in" in out and "ok after revocation" in out, out
    assert out.rstrip().endswith("done"), out
    print(out)
