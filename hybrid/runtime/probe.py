"""What a rank measures of its links and compute for the time model (``hybrid probe``): all-reduce and all-gather
at a small and a large message inside its node and across nodes, a matmul rate, an optimizer step's rate, an
eager op rate and a copy's memory bandwidth on its device (``measure_rank``; every rank of the default group
calls it together). GPU ranks measure their rates all at once, one GPU each; CPU ranks one at a time, each
alone on its host, and report the host and its cores, since they share them (``launch.planning.probe_figures``
divides). The driver fits and keeps the figures (``launch.planning.probe_figures``).

``measure_rank(..., quick=True)`` is the plan's calibration on CPU ranks (``launch.planning.probe_local``): a
few seconds. Its collectives are timed as training meets them -- each call after a short burst of compute on
every rank at once (``_loaded_collective``), so a call also pays for waking its peers and for their turns on
shared cores, which a collective timed back to back (the full probe's) does not see: on a 2-core host 4 ranks'
64 KB all-reduces took 0.4-0.6 ms back to back and 1.5-4 ms in training. Its rates are sustained for
``QUICK_SUSTAIN_S``, and it leaves the optimizer's rate to the tables (torch's first AdamW in a process takes
seconds)."""

from __future__ import annotations

import os
import socket
import time
from typing import Optional

SMALL_BYTES = 64 << 10
LARGE_BYTES = {"cpu": 16 << 20, "cuda": 256 << 20}
MATMUL_N = {"cpu": 1024, "cuda": 8192}
OPTIMIZER_NUMEL = 1 << 22
COPY_BYTES = {"cpu": 64 << 20, "cuda": 1 << 30}
OPS_WIDTH = 16  # the small layer the op rate times: launch and dispatch, next to nothing to compute
REPS = 5
# Seconds a rank computes back to back for a rate. Measured at once, 4 CPU ranks on a 2-core host gave anything
# from 15 to 89 GFLOP/s each (their shares of the cores over one second are the scheduler's), and a 3-call median
# 81-85 each (one core's: the calls barely overlapped); alone, a core's rate is steady (90-100).
SUSTAIN_S = 0.5
QUICK_SUSTAIN_S = 0.05
QUICK_LARGE_BYTES = 1 << 20  # the quick probe's large message (a small model's DP bucket)
BURST_WIDTH = 128  # the compute between two loaded collectives: BURST_MATMULS matmuls of this width (~40 us each)
BURST_MATMULS = 8
LOADED_REPS = 15


def _kind(device) -> str:
    """The size tables' key for ``device``: ``cuda`` or ``cpu``."""
    return "cuda" if device.type == "cuda" else "cpu"


def _median(values: list) -> float:
    ordered = sorted(values)
    return ordered[len(ordered) // 2]


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _collective_call(comm, op: str, nbytes: int, dtype, device):
    """One ``op`` (all_reduce | all_gather) of ``nbytes`` (the all-gather's output) on buffers made once."""
    import torch

    n = comm.size
    numel = max(n, nbytes // torch.empty((), dtype=dtype).element_size() // n * n)
    full = torch.ones(numel, dtype=dtype, device=device)
    shard = torch.ones(numel // n, dtype=dtype, device=device)

    def once():
        if op == "all_reduce":
            comm.all_reduce(full)
        else:
            comm.all_gather(full, shard)

    return once


def _time_collective(comm, op: str, nbytes: int, dtype, device) -> float:
    """Median seconds of one ``op`` (all_reduce | all_gather) of ``nbytes`` (the all-gather's output)."""
    once = _collective_call(comm, op, nbytes, dtype, device)
    once()  # connects the transport (shared memory, NCCL communicators)
    times = []
    for _ in range(REPS):
        comm.barrier()
        _sync(device)
        t0 = time.perf_counter()
        once()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return _median(times)


def _loaded_collective(comm, op: str, nbytes: int, dtype, device, world_barrier) -> float:
    """Median seconds of one ``op`` of ``nbytes`` issued right after a burst of compute (``BURST_MATMULS`` small
    matmuls) on every rank at once, as a micro-step issues its collectives: the call's own time then includes
    waiting for peers that share the cores to get their turn, ``LOADED_REPS`` calls."""
    import torch

    call = _collective_call(comm, op, nbytes, dtype, device)
    a = torch.randn(BURST_WIDTH, BURST_WIDTH, device=device)
    call()
    world_barrier()
    times = []
    for _ in range(LOADED_REPS):
        for _ in range(BURST_MATMULS):
            torch.mm(a, a)
        _sync(device)
        t0 = time.perf_counter()
        call()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return _median(times)


def _group_figures(comm, dtype, device, world_barrier=None) -> Optional[dict]:
    """The group's all-reduce and all-gather at a small and a large size: back to back, or (``world_barrier``
    given: the quick probe) loaded, at its sizes."""
    if comm is None or comm.size < 2:
        return None
    if world_barrier is None:
        large = LARGE_BYTES[_kind(device)]
        return {"size": comm.size, **{op: [[b, _time_collective(comm, op, b, dtype, device)]
                                           for b in (SMALL_BYTES, large)] for op in ("all_reduce", "all_gather")}}
    return {"size": comm.size, "loaded": True,
            **{op: [[b, _loaded_collective(comm, op, b, dtype, device, world_barrier)]
                    for b in (SMALL_BYTES, QUICK_LARGE_BYTES)] for op in ("all_reduce", "all_gather")}}


def _sustained_rate(work, amount: float, device, sustain_s: Optional[float] = None) -> float:
    """``amount`` per second of calling ``work()`` back to back for ``sustain_s`` (default ``SUSTAIN_S``)."""
    sustain_s = sustain_s or SUSTAIN_S
    work()  # warm-up: the first call allocates and loads kernels
    _sync(device)
    calls, t0 = 0, time.perf_counter()
    while True:
        work()
        calls += 1
        _sync(device)
        elapsed = time.perf_counter() - t0
        if elapsed >= sustain_s:
            return amount * calls / elapsed


def _matmul_rate(dtype, device, sustain_s=None) -> float:
    import torch

    n = MATMUL_N[_kind(device)]
    a, b = torch.randn(n, n, device=device).to(dtype), torch.randn(n, n, device=device).to(dtype)
    return _sustained_rate(lambda: a @ b, 2 * n ** 3, device, sustain_s)


def _op_block(device):
    """The op rate's workload: forward and backward of a small layer norm, linear, GELU, linear and residual."""
    import torch

    h = OPS_WIDTH
    layers = [torch.nn.LayerNorm(h), torch.nn.Linear(h, 4 * h), torch.nn.GELU(), torch.nn.Linear(4 * h, h)]
    block = torch.nn.Sequential(*layers).to(device)
    x = torch.randn(2, 4, h, device=device)

    def once():
        (x + block(x)).sum().backward()

    return once


def op_block_count(device="cpu") -> int:
    """The eager ops one pass of the op rate's workload dispatches, counted with a TorchDispatchMode (a process's
    first one takes a second or more: the quick probe counts once, in the driver, and hands the count over)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    class _Count(TorchDispatchMode):
        ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops += 1
            return func(*args, **(kwargs or {}))

    once = _op_block(torch.device(device))
    once()
    counter = _Count()
    with counter:
        once()
    return counter.ops


def _op_rate(device, sustain_s=None, ops=None) -> float:
    """Eager ops per second, autograd included: ``_op_block``'s (what a micro-step dispatches, at a size where
    dispatch is all there is), ``ops`` per pass (default: counted here, ``op_block_count``)."""
    return _sustained_rate(_op_block(device), ops or op_block_count(device), device, sustain_s)


def _memory_bandwidth(device, sustain_s=None) -> float:
    """Bytes per second a large copy moves (read and written) on ``device``."""
    import torch

    n = COPY_BYTES[_kind(device)] // 4
    src, dst = torch.ones(n, device=device), torch.empty(n, device=device)
    return _sustained_rate(lambda: dst.copy_(src), 2 * 4 * n, device, sustain_s)


def _optimizer_rate(device, sustain_s=None) -> float:
    """Parameters per second a fused (else foreach) AdamW steps over fp32 values on ``device``."""
    import torch

    p = torch.nn.Parameter(torch.zeros(OPTIMIZER_NUMEL, device=device))
    p.grad = torch.ones_like(p)
    try:
        opt = torch.optim.AdamW([p], fused=True)
        opt.step()
    except (RuntimeError, ValueError):
        opt = torch.optim.AdamW([p], foreach=True)
    return _sustained_rate(opt.step, OPTIMIZER_NUMEL, device, sustain_s)


def _host_id() -> str:
    """What the ranks of one machine have in common (simulated Ray nodes on one host share its cores)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}|{boot}"


def measure_rank(rank: int, world_size: int, ranks_per_node: int, device: str, precision: str,
                 quick: bool = False, op_count: Optional[int] = None) -> dict:
    """This rank's figures (see above; ``quick``: the plan's calibration, collectives loaded; ``op_count``:
    ``op_block_count()`` where the caller counted it); every rank of the default group calls it together."""
    import torch
    import torch.distributed as dist

    from hybrid.comm.collectives import Comm

    dev = torch.device(device)
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    nodes, g = world_size // ranks_per_node, ranks_per_node
    node, local = rank // g, rank % g
    # every rank creates every group, in one order, as torch.distributed requires
    intra = [dist.new_group(list(range(n * g, (n + 1) * g))) for n in range(nodes)]
    inter = [dist.new_group([n * g + j for n in range(nodes)]) for j in range(g)]
    figures = {"rank": rank, "node": node, "local_rank": local,
               "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"}
    loaded = dist.barrier if quick else None
    started = time.perf_counter()
    figures["intra"] = _group_figures(Comm(intra[node], "probe-intra") if g > 1 else None, dtype, dev, loaded)
    figures["inter"] = _group_figures(Comm(inter[local], "probe-inter") if nodes > 1 else None, dtype, dev, loaded)
    figures["seconds_links"] = time.perf_counter() - started
    sustain = QUICK_SUSTAIN_S if quick else SUSTAIN_S
    rates = {"matmul_flops": lambda: _matmul_rate(dtype, dev, sustain),
             "op_rate": lambda: _op_rate(dev, sustain, op_count), "memory_bandwidth": lambda: _memory_bandwidth(dev, sustain)}
    if not quick:  # torch.optim's first AdamW in a process takes seconds; the quick probe keeps the table's rate
        rates["optimizer_rate"] = lambda: _optimizer_rate(dev, sustain)
    if dev.type == "cuda":  # a GPU each: all ranks at once, as they train, each rate started together
        for key, measure in rates.items():
            dist.barrier()
            figures[key] = measure()
    else:  # CPU ranks share their host's cores: each alone, the others waiting (the sharing is summarize's)
        for turn in range(world_size):
            dist.barrier()
            if turn == rank:
                figures.update({key: measure() for key, measure in rates.items()})
        dist.barrier()
        figures.update(host=_host_id(), cores=len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                       else os.cpu_count() or 1)
    figures["seconds"] = time.perf_counter() - started
    for group in intra + inter:
        dist.destroy_process_group(group)
    return figures
