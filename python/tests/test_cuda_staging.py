"""The pure parts of the CUDA staging (``cohort.torch.cuda``), on any machine: how a tensor is
cut into chunks and how pinned buffers are sized for reuse. The staging itself needs a GPU:
python/tests/test_cuda.py, run by scripts/device-check.sh."""

from conftest import import_torch

import_torch()

from cohort.torch import cuda  # noqa: E402 - after the torch check


def test_chunks_cover_the_tensor_once_in_order():
    cases = ((1, 4, 4 << 20), (1_048_576, 4, 4 << 20), (3_000_001, 4, 4 << 20), (10, 2, 6), (7, 8, 3))
    for numel, size, chunk in cases:
        ranges = cuda.chunks(numel, size, chunk)
        assert ranges[0][0] == 0 and ranges[-1][1] == numel
        assert all(a < b for a, b in ranges)
        assert all(ranges[i][1] == ranges[i + 1][0] for i in range(len(ranges) - 1))
        per = max(1, chunk // size)
        assert all(b - a <= per for a, b in ranges)
        assert len(ranges) == -(-numel // per)
    assert cuda.chunks(3_000_001, 4, 4 << 20) == [(0, 1_048_576), (1_048_576, 2_097_152), (2_097_152, 3_000_001)]
    # An element larger than a chunk still travels, one element at a time.
    assert cuda.chunks(3, 8, 3) == [(0, 1), (1, 2), (2, 3)]


def test_an_empty_tensor_is_one_empty_chunk():
    assert cuda.chunks(0, 4, 4 << 20) == [(0, 0)]


def test_pinned_buffers_come_in_powers_of_two_from_64_kib():
    assert cuda.PinnedPool._class_of(1) == 64 << 10
    assert cuda.PinnedPool._class_of(64 << 10) == 64 << 10
    assert cuda.PinnedPool._class_of((64 << 10) + 1) == 128 << 10
    assert cuda.PinnedPool._class_of(12_000_004) == 16 << 20
