"""Real multi-process runs of hybrid.comm.shm through hybrid.comm: results against gloo's own
collectives, slicing, fallback agreement, a peer that exits, and nothing left in /dev/shm."""

import os

import pytest
import torch
import torch.distributed as dist

from hybrid.runtime.local_launch import LocalRunError, run_local

pytestmark = pytest.mark.slow


def _small_slices():
    import hybrid.comm.collectives as comm_module
    import hybrid.comm.shm as shm

    shm.SLICE_BYTES = 64  # 16 fp32 / 32 bf16 elements per slice: many slices, a short last one
    comm_module.SHM_MIN_BYTES = 0


def _against_gloo():
    _small_slices()
    from hybrid.comm.collectives import Comm

    comm = Comm(name="world")
    r, n = comm.rank, comm.size
    gen = torch.Generator().manual_seed(r)
    results = []
    for dtype in (torch.float32, torch.bfloat16, torch.int64):
        for numel in (1, n * 16 + 1, 101, 333):
            x = (torch.randn(numel, generator=gen) * 100).to(dtype)
            expected = x.clone()
            dist.all_reduce(expected)
            got = x.clone()
            comm.all_reduce(got)
            mean = x.clone().float()
            h = comm.all_reduce(mean, average=True, async_op=True)
            ref_mean = x.clone().float()
            dist.all_reduce(ref_mean)
            h.wait()
            results.append(("all_reduce", str(dtype), numel, _close(got, expected, dtype),
                            torch.allclose(mean, ref_mean / n, rtol=1e-5, atol=1e-3)))
            # the engine's reduce-scatter: the output is this rank's part of the input
            bucket = (torch.randn(numel * n, generator=gen) * 100).to(dtype)
            keep = bucket.clone()
            summed = bucket.clone()
            dist.all_reduce(summed)
            own = bucket.tensor_split(n)[r]
            comm.reduce_scatter(own, bucket, async_op=True).wait()
            others = [q for q in range(n) if q != r]
            untouched = all(torch.equal(bucket.tensor_split(n)[q], keep.tensor_split(n)[q]) for q in others)
            results.append(("reduce_scatter", str(dtype), numel, _close(own, summed.tensor_split(n)[r], dtype),
                            untouched))
            chunk = (torch.randn(numel, generator=gen) * 100).to(dtype)
            out = torch.empty(numel * n, dtype=dtype)
            comm.all_gather(out, chunk)
            ref = [torch.empty(numel, dtype=dtype) for _ in range(n)]
            dist.all_gather(ref, chunk)
            results.append(("all_gather", str(dtype), numel, torch.equal(out, torch.cat(ref)), True))
    return results, comm.transports.cpu.shm is not None, comm.report(), [b.numel() for b in comm.buffer_tensors()]


def _close(got, expected, dtype):
    if dtype == torch.bfloat16:  # summed in another order
        return torch.allclose(got.float(), expected.float(), rtol=2e-2, atol=1.0)
    return torch.allclose(got.double(), expected.double(), rtol=1e-6, atol=1e-4)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_shared_memory_collectives_match_gloo(world):
    import hybrid.comm.shm as shm

    before = _our_files()
    for results, connected, report, kept in run_local(_against_gloo, world):
        assert connected
        bad = [row for row in results if not (row[3] and row[4])]
        assert not bad, bad
        assert report["all_reduce_calls"] == 24 and report["reduce_scatter_calls"] == 12  # counted as before
        assert kept == [2 * (world - 1) * 64], "the region in the memory report (SLICE_BYTES as set in the rank)"
        assert shm.region_bytes(world) == 2 * (world - 1) * shm.slot_bytes(world) <= 2 * shm.SLICE_BYTES
    assert _our_files() == before, "nothing is left in /dev/shm"


def _our_files():
    return sorted(f for f in os.listdir("/dev/shm") if f.startswith("hybrid-shm-"))


def _one_rank_opts_out(opt_out_rank):
    _small_slices()
    from hybrid.comm.collectives import Comm

    if dist.get_rank() == opt_out_rank:
        os.environ["HYBRID_SHM_COLLECTIVES"] = "0"
    comm = Comm(name="world")
    x = torch.full((1000,), float(comm.rank + 1))
    comm.all_reduce(x)
    return comm.transports.cpu.shm is None, x[0].item()


def test_one_rank_without_shared_memory_makes_the_group_fall_back():
    for fell_back, value in run_local(_one_rank_opts_out, 3, 1):
        assert fell_back and value == 6.0


def _other_host(other_rank):
    _small_slices()
    import hybrid.comm.shm as shm
    from hybrid.comm.collectives import Comm

    if dist.get_rank() == other_rank:
        shm._host_key = lambda: "another machine"
    comm = Comm(name="world")
    x = torch.full((1000,), float(comm.rank + 1))
    comm.reduce_scatter(x.tensor_split(comm.size)[comm.rank], x)
    return comm.transports.cpu.shm is None, x.tensor_split(comm.size)[comm.rank].tolist()


def test_ranks_on_different_hosts_use_gloo():
    for rank, (fell_back, own) in enumerate(run_local(_other_host, 2, 0)):
        assert fell_back and own == [3.0] * 500


def _peer_exits():
    _small_slices()
    from hybrid.comm.collectives import Comm

    comm = Comm(name="world")
    x = torch.ones(1000)
    comm.all_reduce(x)  # connected
    if comm.rank == 1:
        os._exit(3)
    comm.all_reduce(x)
    return "finished"


def test_a_peer_that_exits_is_an_error_not_a_hang():
    with pytest.raises(LocalRunError, match=r"global rank 1 \(rank 1\) of the group exited during a collective"):
        run_local(_peer_exits, 2, timeout_s=60)


def _mismatched_sizes():
    _small_slices()
    from hybrid.comm.collectives import Comm

    comm = Comm(name="world")
    comm.all_reduce(torch.ones(8))  # connected
    n = 64 if comm.rank == 0 else 40  # stage 3 on ranks that gather different units
    comm.all_gather(torch.zeros(2 * n), torch.ones(n))
    return "mixed silently"


def test_ranks_issuing_different_collectives_are_an_error():
    with pytest.raises(LocalRunError, match="issued a different collective than this rank's all_gather of "
                                            r"(128|80) float32 elements"):
        run_local(_mismatched_sizes, 2, timeout_s=60)


def _fork_and_exit():
    _small_slices()
    from hybrid.comm.collectives import Comm

    comm = Comm(name="world")
    x = torch.ones(1000)
    comm.all_reduce(x)
    if comm.rank == 1:
        pid = os.fork()
        if pid == 0:  # a DataLoader-like child that outlives its rank
            import time
            time.sleep(20)
            os._exit(0)
        os._exit(3)
    comm.all_reduce(x)
    return "finished"


def test_a_forked_child_does_not_keep_a_dead_rank_looking_alive():
    import time

    start = time.monotonic()
    with pytest.raises(LocalRunError, match=r"global rank 1 \(rank 1\) of the group exited during a collective"):
        run_local(_fork_and_exit, 2, timeout_s=60)
    assert time.monotonic() - start < 15


def _spy(shm_group, carried: list) -> None:
    """Record the collectives ``shm_group`` carries in ``carried``."""
    for op in ("all_reduce", "reduce_scatter", "all_gather"):
        method = getattr(shm_group, op)
        setattr(shm_group, op, lambda *a, _op=op, _method=method, **k: carried.append(_op) or _method(*a, **k))


def _chosen_once():
    _small_slices()
    import hybrid.comm.collectives as comm_module
    from hybrid.comm.collectives import Comm

    chosen, choose = [], comm_module._choose_transports
    comm_module._choose_transports = lambda group, name: chosen.append(name) or choose(group, name)
    a, b = Comm(name="world"), Comm(None, name="checkpoint")  # two Comms over the default group
    cpu = a.transports.cpu
    chain = [type(t).__name__ for t in (cpu, cpu.fallback, cpu.fallback.fallback)]
    own_below = cpu.fallback.fallback is a.transports.own
    x = torch.ones(1000)
    a.all_reduce(x)  # a's shared-memory transport connects the group
    shm, carried = cpu.shm, []
    _spy(shm, carried)
    comm_module.SHM_MIN_BYTES = 1 << 40  # read when a Comm chooses its transports: no collective re-decides
    a.all_reduce(x)
    b.all_gather(torch.empty(2000), torch.ones(1000))  # b's first call finds the group's connection
    shared = b.transports.cpu.shm is shm
    late = Comm(name="late")  # chooses with the threshold as it is now: gloo carries
    late.all_reduce(x)
    a.close()
    try:
        a.all_reduce(x)
        refused = None
    except RuntimeError as e:
        refused = str(e)
    open_while_b_holds = not shm.closed
    b.close()  # the last Comm holding the connection: closed
    comm_module.SHM_MIN_BYTES = 0
    again = Comm(name="again")
    again.all_reduce(x)  # connects anew
    reconnected = again.transports.cpu.shm not in (None, shm)

    sub_group = dist.new_group()
    sub = Comm(sub_group, name="sub")
    sub.all_reduce(torch.ones(100))
    sub_shm = sub.transports.cpu.shm
    dist.destroy_process_group(sub_group)
    Comm(name="after")  # the next Comm made closes the connections of destroyed groups
    return (chain, own_below, chosen, carried, x.tolist(), shared, refused, open_while_b_holds, shm.closed,
            reconnected, sub_shm is not None and sub_shm.closed)


def test_transports_are_chosen_once_and_the_connection_released_with_its_last_holder():
    for out in run_local(_chosen_once, 2):
        chain, own_below, chosen, carried, x, shared, refused, open_while_b_holds, closed, reconnected, sub = out
        assert chain == ["SharedMemoryTransport", "ExchangeTransport", "ProcessGroupTransport"] and own_below
        assert chosen == ["world", "checkpoint", "late", "again", "sub", "after"], "once per Comm, not per call"
        # shared memory carried a's and b's calls (an all-reduce is its reduce-scatter and all-gather) with the
        # threshold as it was when they chose, over one connection; late's went to gloo
        assert carried == ["all_reduce", "reduce_scatter", "all_gather", "all_gather"] and shared
        assert x == [16.0] * 1000
        assert refused == "a collective on the closed Comm 'world'"
        assert open_while_b_holds and closed and reconnected
        assert sub, "a destroyed group's connection is closed"


def _every_op(comm) -> tuple:
    r, n = comm.rank, comm.size
    summed = torch.arange(40.0) * (r + 1)
    comm.all_reduce(summed)
    mean = torch.arange(40.0) + r
    comm.all_reduce(mean, average=True, async_op=True).wait()
    bucket = torch.arange(40.0 * n) * (r + 1)
    part = bucket.tensor_split(n)[r]
    comm.reduce_scatter(part, bucket, average=True, async_op=True).wait()
    gathered = torch.empty(40 * n)
    comm.all_gather(gathered, torch.full((40,), float(r)))
    sent = torch.full((40,), float(r))
    comm.broadcast(sent, 1)
    return [summed.tolist(), mean.tolist(), part.tolist(), gathered.tolist(), sent.tolist()], comm.report()


def _same_traffic_whichever_transport():
    _small_slices()
    import hybrid.comm.collectives as comm_module
    from hybrid.comm.collectives import Comm, GroupTransports

    comm_module.EXCHANGE_MIN_NUMEL = 0  # the exchange carries every all-reduce shared memory does not
    shm = Comm(name="shm")
    via_shm = _every_op(shm)
    os.environ["HYBRID_SHM_COLLECTIVES"] = "0"  # on every rank: this group's shared memory refuses to connect
    exchange = Comm(dist.new_group(), name="exchange")
    via_exchange = _every_op(exchange)
    del os.environ["HYBRID_SHM_COLLECTIVES"]
    own = Comm(dist.new_group(), name="own")
    own.transports = GroupTransports(cpu=own.transports.own, own=own.transports.own)  # torch.distributed alone
    via_own = _every_op(own)
    carriers = (shm.transports.cpu.shm is not None, exchange.transports.cpu.shm is None,
                len(exchange.transports.cpu.fallback.pool.kept()) > 0)
    return (via_shm, via_exchange, via_own), carriers


def test_traffic_is_counted_the_same_whichever_transport_carries_it():
    for (via_shm, via_exchange, via_own), carriers in run_local(_same_traffic_whichever_transport, 2):
        assert carriers == (True, True, True)
        assert via_shm == via_exchange == via_own
        values, report = via_own
        assert values[0] == (torch.arange(40.0) * 3).tolist() and values[1] == (torch.arange(40.0) + 0.5).tolist()
        assert report["all_reduce"] == 2 * 2 * 160 and report["reduce_scatter"] == report["all_gather"] == 320
        assert report["broadcast"] == 160 and report["total_calls"] == 5
