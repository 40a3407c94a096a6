"""Run a function on N local ranks with a real process group (gloo on CPU, nccl on CUDA).

Used by the multi-process tests and the benchmarks; the production launcher is Ray (``launch/``).
``run_local(fn, world_size, *args)`` spawns ``world_size`` processes, initializes the default process
group on 127.0.0.1 with a free port, calls ``fn(*args)`` on each, and returns the per-rank results in
rank order. A failure on any rank raises ``LocalRunError`` carrying that rank's traceback; the other
ranks are terminated, never left behind.
"""

from __future__ import annotations

import os
import pickle
import socket
import traceback
from datetime import timedelta
from typing import Any, Callable

import torch.multiprocessing as mp


class LocalRunError(RuntimeError):
    pass


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world_size: int, port: int, backend: str, timeout_s: float, threads: int,
           fn: Callable, args: tuple, queue) -> None:
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    torch.set_num_threads(threads)
    try:
        dist.init_process_group(backend, rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=timeout_s))
        result = fn(*args)
        # Rank 0 hosts the rendezvous store: no rank may tear down while a peer still talks to it.
        dist.barrier()
        # Plain pickle: torch's queue would pass tensors as handles into this process's shared memory,
        # which vanish when the rank exits.
        queue.put((rank, True, pickle.dumps(result)))
    except BaseException:  # report everything, including KeyboardInterrupt, to the parent
        queue.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_local(fn: Callable, world_size: int, *args: Any, backend: str = "gloo", timeout_s: float = 120.0,
              threads: int = 1) -> list:
    """Run ``fn(*args)`` on ``world_size`` spawned ranks; return their results in rank order."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(r, world_size, port, backend, timeout_s, threads, fn, args, queue),
                         daemon=False)
             for r in range(world_size)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    try:
        while len(results) < world_size:
            try:
                rank, ok, payload = queue.get(timeout=timeout_s + 60)
            except Exception as exc:  # queue.Empty: a rank died without reporting
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
                raise LocalRunError(f"ranks {dead or 'unknown'} stopped without a result") from exc
            if not ok:
                raise LocalRunError(f"rank {rank} failed:\n{payload}")
            results[rank] = pickle.loads(payload)
        for p in procs:
            p.join(timeout=30)
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)
    return [results[r] for r in range(world_size)]
