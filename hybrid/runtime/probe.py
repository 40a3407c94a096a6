"""What a rank measures of its links and compute for the time model (``hybrid probe``): all-reduce and all-gather
at a small and a large message inside its node and across nodes, a matmul rate, an optimizer step's rate, an
eager op rate and a copy's memory bandwidth on its device (``measure_rank``; every rank of the default group
calls it together). GPU ranks measure their rates all at once, one GPU each; CPU ranks one at a time, each
alone on its host, and report the host and its cores, since they share them (``launch.planning.probe_figures``
divides). The driver fits and keeps the figures (``launch.planning.probe_figures``)."""

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


def _time_collective(comm, op: str, nbytes: int, dtype, device) -> float:
    """Median seconds of one ``op`` (all_reduce | all_gather) of ``nbytes`` (the all-gather's output)."""
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


def _group_figures(comm, dtype, device) -> Optional[dict]:
    if comm is None or comm.size < 2:
        return None
    large = LARGE_BYTES[_kind(device)]
    return {"size": comm.size, **{op: [[b, _time_collective(comm, op, b, dtype, device)] for b in (SMALL_BYTES, large)]
                                  for op in ("all_reduce", "all_gather")}}


def _sustained_rate(work, amount: float, device) -> float:
    """``amount`` per second of calling ``work()`` back to back for ``SUSTAIN_S``."""
    work()  # warm-up: the first call allocates and loads kernels
    _sync(device)
    calls, t0 = 0, time.perf_counter()
    while True:
        work()
        calls += 1
        _sync(device)
        elapsed = time.perf_counter() - t0
        if elapsed >= SUSTAIN_S:
            return amount * calls / elapsed


def _matmul_rate(dtype, device) -> float:
    import torch

    n = MATMUL_N[_kind(device)]
    a, b = torch.randn(n, n, device=device).to(dtype), torch.randn(n, n, device=device).to(dtype)
    return _sustained_rate(lambda: a @ b, 2 * n ** 3, device)


def _op_rate(device) -> float:
    """Eager ops per second, autograd included: forward and backward of a small layer norm, linear, GELU,
    linear and residual (what a micro-step dispatches, at a size where dispatch is all there is)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    class _Count(TorchDispatchMode):
        ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops += 1
            return func(*args, **(kwargs or {}))

    h = OPS_WIDTH
    layers = [torch.nn.LayerNorm(h), torch.nn.Linear(h, 4 * h), torch.nn.GELU(), torch.nn.Linear(4 * h, h)]
    block = torch.nn.Sequential(*layers).to(device)
    x = torch.randn(2, 4, h, device=device)

    def once():
        (x + block(x)).sum().backward()

    once()
    counter = _Count()
    with counter:
        once()
    return _sustained_rate(once, counter.ops, device)


def _memory_bandwidth(device) -> float:
    """Bytes per second a large copy moves (read and written) on ``device``."""
    import torch

    n = COPY_BYTES[_kind(device)] // 4
    src, dst = torch.ones(n, device=device), torch.empty(n, device=device)
    return _sustained_rate(lambda: dst.copy_(src), 2 * 4 * n, device)


def _optimizer_rate(device) -> float:
    """Parameters per second a fused (else foreach) AdamW steps over fp32 values on ``device``."""
    import torch

    p = torch.nn.Parameter(torch.zeros(OPTIMIZER_NUMEL, device=device))
    p.grad = torch.ones_like(p)
    try:
        opt = torch.optim.AdamW([p], fused=True)
        opt.step()
    except (RuntimeError, ValueError):
        opt = torch.optim.AdamW([p], foreach=True)
    return _sustained_rate(opt.step, OPTIMIZER_NUMEL, device)


def _host_id() -> str:
    """What the ranks of one machine have in common (simulated Ray nodes on one host share its cores)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}|{boot}"


def measure_rank(rank: int, world_size: int, ranks_per_node: int, device: str, precision: str) -> dict:
    """This rank's figures (see above); every rank of the default group calls it together."""
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
    figures["intra"] = _group_figures(Comm(intra[node], "probe-intra") if g > 1 else None, dtype, dev)
    figures["inter"] = _group_figures(Comm(inter[local], "probe-inter") if nodes > 1 else None, dtype, dev)
    rates = {"matmul_flops": lambda: _matmul_rate(dtype, dev), "optimizer_rate": lambda: _optimizer_rate(dev),
             "op_rate": lambda: _op_rate(dev), "memory_bandwidth": lambda: _memory_bandwidth(dev)}
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
    for group in intra + inter:
        dist.destroy_process_group(group)
    return figures
