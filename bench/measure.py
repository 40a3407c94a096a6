"""One implementation's training run on one rank, timed and measured.

``run_rank(impl, stage, workload)`` runs inside a freshly spawned rank (``hybrid.runtime.local_launch.run_local``)
and returns plain data: the loss and wall time of every step, the RSS before the model was built (after the
implementation's and the model's imports) and the
peak RSS of the process, the model-state bytes held, and (hybrid only) the traffic per timed step.

Each step is framed by barriers, so its time on every rank is the time of the slowest rank; a world of one
rank (the compute floor) has no barrier, so its step issues no collective at all. Model-state
bytes are read between backward and optimizer step of the last warm-up step: gradients are alive and the
optimizer state has been allocated by the earlier steps, and no timed step pays for the counting.
With ``profile=True`` the timed steps run under ``torch.profiler`` and the op table comes back too.
"""

from __future__ import annotations

import os
import resource
import sys
import time

import torch
import torch.distributed as dist

from bench import peers
from bench.workload import Workload, batch, build_model, import_model_code


def run_rank(impl: str, stage: int, w: Workload, profile: bool = False) -> dict:
    if w.warmup < 2:
        raise ValueError("warmup must be >= 2: the optimizer state exists only after the first step")
    rank = dist.get_rank()
    sync = dist.barrier if dist.get_world_size() > 1 else _no_barrier
    peers.import_library(impl)
    import_model_code()  # the workload's, not the implementation's: before the baseline for every row
    rss_before = current_rss_bytes()
    model = build_model(w)
    runner = peers.setup(impl, stage, model, w)

    losses, times, state_bytes, profiler = [], [], None, None
    for step in range(w.warmup + w.steps):
        if profile and step == w.warmup:
            profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
            profiler.__enter__()
        idx, targets = batch(w, step, rank)
        sync()
        t0 = time.perf_counter()
        loss = runner.forward_backward(idx, targets)
        if step == w.warmup - 1:
            state_bytes = runner.model_state_bytes()
        runner.optimizer_step()
        sync()
        times.append(time.perf_counter() - t0)
        losses.append(float(loss))
        if step == w.warmup - 1:
            runner.reset_traffic()

    profile_table = None
    if profiler is not None:
        profiler.__exit__(None, None, None)
        profile_table = profiler.key_averages().table(sort_by="cpu_time_total", row_limit=40)
    traffic = runner.traffic()
    if traffic is not None:
        traffic = {k: v / w.steps for k, v in traffic.items()}
    return dict(rank=rank, losses=losses, times=times[w.warmup:], rss_before=rss_before,
                peak_rss=peak_rss_bytes(), state_bytes=state_bytes, traffic=traffic, profile=profile_table)


def _no_barrier() -> None:
    """A one-rank world has nobody to wait for."""


def current_rss_bytes() -> int:
    try:
        import psutil

        return psutil.Process().memory_info().rss
    except ImportError:  # psutil comes with the bench extra; the quick test may run without it
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_rss_bytes() -> int:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # Linux reports KiB
