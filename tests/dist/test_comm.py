"""Real gloo runs of hybrid.comm: results and byte accounting."""

import pytest
import torch
import torch.distributed as dist

from hybrid.comm import Comm
from hybrid.local_launch import run_local

pytestmark = pytest.mark.slow


def _collectives():
    comm = Comm(name="world")
    r, n = comm.rank, comm.size
    x = torch.full((6,), float(r + 1))
    comm.all_reduce(x, average=True).wait()
    full = torch.arange(4 * n, dtype=torch.float32) + r
    shard = torch.empty(4)
    comm.reduce_scatter(shard, full).wait()
    gathered = torch.empty(4 * n, dtype=torch.bfloat16)
    h = comm.all_gather(gathered, torch.full((4,), float(r), dtype=torch.bfloat16), async_op=True)
    h.wait()
    # the engine's form: the output is this rank's slice of the input (gloo: an in-place all-reduce)
    bucket = torch.arange(4 * n, dtype=torch.float32) + r
    own = bucket[4 * r:4 * r + 4]
    comm.reduce_scatter(own, bucket, average=True, async_op=True).wait()
    # an all-gather whose input already is this rank's chunk of the output
    out = torch.zeros(3 * n)
    out[3 * r:3 * r + 3] = float(r) + 0.5
    comm.all_gather(out, out[3 * r:3 * r + 3]).wait()
    return x.tolist(), shard.tolist(), gathered.float().tolist(), own.tolist(), out.tolist(), comm.report()


@pytest.mark.parametrize("world", [2, 4])
def test_collectives_and_byte_counts(world):
    out = run_local(_collectives, world)
    mean = sum(range(1, world + 1)) / world
    for rank, (x, shard, gathered, own, out_, report) in enumerate(out):
        assert x == [mean] * 6
        base = torch.arange(4 * world, dtype=torch.float32) * world + sum(range(world))
        assert shard == base[4 * rank: 4 * rank + 4].tolist()
        assert own == (base[4 * rank: 4 * rank + 4] / world).tolist()
        assert gathered == [float(r) for r in range(world) for _ in range(4)]
        assert out_ == [r + 0.5 for r in range(world) for _ in range(3)]
        assert report["all_reduce"] == 2 * 6 * 4  # the emulations count as what they stand for
        assert report["reduce_scatter"] == 2 * 4 * world * 4
        assert report["all_gather"] == 4 * world * 2 + 3 * world * 4
        assert report["total"] == 48 + 32 * world + 8 * world + 12 * world


def test_group_of_one_moves_nothing():
    comm = Comm(name="solo")
    t = torch.ones(3)
    comm.all_reduce(t).wait()
    out = torch.empty(3)
    comm.all_gather(out, t).wait()
    assert out.tolist() == [1.0] * 3 and comm.report()["total"] == 0
