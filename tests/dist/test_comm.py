"""Real gloo runs of hybrid.comm: results, byte accounting and collective counts."""

import pytest
import torch
import torch.distributed as dist

from hybrid.comm.collectives import Comm
from hybrid.runtime.local_launch import run_local

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
        calls = {k: v for k, v in report.items() if k.endswith("_calls")}
        assert calls == dict(all_reduce_calls=1, reduce_scatter_calls=2, all_gather_calls=2, broadcast_calls=0,
                             total_calls=5)


def test_group_of_one_moves_nothing():
    comm = Comm(name="solo")
    t = torch.ones(3)
    comm.all_reduce(t).wait()
    out = torch.empty(3)
    comm.all_gather(out, t).wait()
    assert out.tolist() == [1.0] * 3 and comm.report()["total"] == 0 and comm.report()["total_calls"] == 0


def _exchange_in_slices():
    import hybrid.comm.collectives as comm_module

    comm_module.EXCHANGE_NUMEL = 3  # 7 elements per rank: slices of 3, 3 and 1, two in flight
    comm = Comm(name="world")
    r, n = comm.rank, comm.size
    buckets = [torch.arange(7 * n, dtype=torch.float32) * (k + 1) + r for k in range(3)]
    own = [b[7 * r:7 * r + 7] for b in buckets]
    handles = [comm.reduce_scatter(o, b, async_op=True) for o, b in zip(own, buckets)]  # three in flight
    for h in reversed(handles):
        h.wait()
    untouched = [b[7 * ((r + 1) % n):7 * ((r + 1) % n) + 7].tolist() for b in buckets]
    return [o.tolist() for o in own], untouched


@pytest.mark.parametrize("world", [2, 3])
def test_pairwise_reduce_scatter_in_slices(world):
    """The gloo reduce-scatter exchanges slices pairwise: several in flight, waited out of order, a short
    last slice; each rank's slice holds the sum and the others keep this rank's own values."""
    for rank, (own, untouched) in enumerate(run_local(_exchange_in_slices, world)):
        for k in range(3):
            full = torch.arange(7 * world, dtype=torch.float32) * (k + 1)
            assert own[k] == (full[7 * rank:7 * rank + 7] * world + sum(range(world))).tolist()
            peer = (rank + 1) % world
            assert untouched[k] == (full[7 * peer:7 * peer + 7] + rank).tolist()


def _exchange_all_reduce():
    import hybrid.comm.collectives as comm_module

    comm_module.EXCHANGE_NUMEL, comm_module.EXCHANGE_MIN_NUMEL = 2, 4  # several slices, uneven parts
    comm = Comm(name="world")
    r = comm.rank
    summed = torch.arange(11, dtype=torch.float32) * (r + 1)  # 11 elements: parts of 4/4/3 on 3 ranks
    comm.all_reduce(summed).wait()
    averaged = torch.full((9,), float(r + 1))
    handle = comm.all_reduce(averaged, average=True, async_op=True)
    small = torch.full((3,), float(r))  # below EXCHANGE_MIN_NUMEL: gloo's own all-reduce
    comm.all_reduce(small).wait()
    handle.wait()
    return summed.tolist(), averaged.tolist(), small.tolist(), comm.report()["all_reduce"]


@pytest.mark.parametrize("world", [2, 3])
def test_all_reduce_as_exchange_and_broadcasts(world):
    total = sum(range(1, world + 1))
    for summed, averaged, small, counted in run_local(_exchange_all_reduce, world):
        assert summed == (torch.arange(11, dtype=torch.float32) * total).tolist()
        assert averaged == [total / world] * 9
        assert small == [float(sum(range(world)))] * 3
        assert counted == 2 * 4 * (11 + 9 + 3)  # counted as the all-reduces they stand for


def _broadcast_many():
    import hybrid.comm.collectives as comm_module

    comm = Comm(name="world")
    r = comm.rank
    comm_module.COALESCE_MAX_NUMEL = 64  # so one tensor goes by itself
    small = [torch.full((3,), float(r)), torch.full((2, 2), r, dtype=torch.int64), torch.empty(0),
             torch.full((5, 4), float(r)).t()]  # a non-contiguous one
    big = torch.full((100,), float(r) + 0.5)
    comm.broadcast_many(small + [big, small[0]], 1)  # small[0] listed twice moves once
    report = comm.report()
    return [t.tolist() for t in small] + [big.tolist()], report["broadcast_calls"], report["broadcast"]


@pytest.mark.parametrize("world", [2, 3])
def test_broadcast_many_packs_small_tensors_per_dtype(world):
    for rank, (values, calls, nbytes) in enumerate(run_local(_broadcast_many, world)):
        assert values == [[1.0] * 3, [[1, 1], [1, 1]], [], [[1.0] * 5] * 4, [1.5] * 100], rank
        assert calls == 3  # float32 pack, int64 pack, the big one
        assert nbytes == (3 + 20) * 4 + 4 * 8 + 100 * 4
