"""Layout-independent initializers: any range, any TP slice, equals the same part of the full draw."""

import math

import pytest
import torch

from hybrid.weights.init import (CHUNK, Constant, Normal, Uniform, full_values, local_values, read_local_range)
from hybrid.tp.sharding import tp_slice


@pytest.mark.parametrize("init", [Normal(std=0.5), Uniform(low=-2.0, high=3.0), Constant(value=1.5)])
def test_every_range_is_the_same_part_of_the_full_draw(init):
    numel = 2 * CHUNK + 123
    full = full_values(init, 7, "w", numel, 0, numel)
    assert full.shape == (numel,) and full.dtype == torch.float32
    for lo, hi in [(0, 1), (5, CHUNK + 9), (CHUNK - 1, CHUNK + 1), (2 * CHUNK, numel), (17, 17)]:
        assert torch.equal(full_values(init, 7, "w", numel, lo, hi), full[lo:hi])


def test_values_depend_on_seed_and_key_only():
    a = full_values(Normal(std=1.0), 1, "a", 100, 0, 100)
    assert torch.equal(a, full_values(Normal(std=1.0), 1, "a", 100, 0, 100))
    assert not torch.equal(a, full_values(Normal(std=1.0), 2, "a", 100, 0, 100))
    assert not torch.equal(a, full_values(Normal(std=1.0), 1, "b", 100, 0, 100))
    assert abs(float(full_values(Normal(std=0.02), 0, "x", 10 ** 5, 0, 10 ** 5).std()) - 0.02) < 1e-3


@pytest.mark.parametrize("shape, dim, tp", [((8, 12), 0, 4), ((8, 12), 1, 4), ((6, 4, 10), 1, 2),
                                            ((6, 4, 10), 2, 5), ((30,), 0, 3), ((8, 12), None, 1)])
def test_local_ranges_of_tp_slices(shape, dim, tp):
    full = torch.arange(math.prod(shape), dtype=torch.float32).view(shape)
    reads = []

    def read_full(a, b):
        reads.append(b - a)
        return full.reshape(-1)[a:b]

    for rank in range(tp):
        local = tp_slice(full, dim, rank, tp).reshape(-1)
        n = local.numel()
        for lo, hi in [(0, n), (1, n - 1), (n // 2, n // 2 + 1), (n - 3, n), (2, 2)]:
            got = read_local_range(read_full, shape, dim, rank, tp, lo, hi)
            assert torch.equal(got, local[lo:hi]), (rank, lo, hi)
    assert max(reads) <= full.numel()


def test_local_values_are_slices_of_the_single_process_tensor():
    init, shape = Normal(std=1.0), (64, 48)
    full = local_values(init, 3, "w", shape, None, 0, 1, 0, 64 * 48).view(shape)
    for dim in (0, 1):
        for rank in range(4):
            local = local_values(init, 3, "w", shape, dim, rank, 4, 0, 64 * 48 // 4)
            assert torch.equal(local, tp_slice(full, dim, rank, 4).reshape(-1))
