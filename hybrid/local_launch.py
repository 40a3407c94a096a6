"""Run a function on N local ranks with a real process group (gloo on CPU, nccl on CUDA).

Used by the multi-process tests and the benchmarks; the production launcher is Ray (``launch/``).
``run_local(fn, world_size, *args)`` spawns ``world_size`` processes, initializes the default process
group through a file store in a private temporary directory, calls ``fn(*args)`` on each, and returns
the per-rank results in rank order. A failure on any rank raises ``LocalRunError`` carrying that rank's
traceback; the other ranks are terminated, never left behind.

Why a file store and not MASTER_ADDR/PORT: torch's TCP store client connects over a v4-mapped IPv6
socket and then resolves the peer's name, which sends a DNS query off this machine. gloo itself still
talks over loopback (``GLOO_SOCKET_IFNAME=lo``).
"""

from __future__ import annotations

import os
import pickle
import shutil
import tempfile
import traceback
from datetime import timedelta
from typing import Any, Callable

import torch.multiprocessing as mp


class LocalRunError(RuntimeError):
    pass


def _entry(rank: int, world_size: int, store_file: str, backend: str, timeout_s: float, threads: int,
           fn: Callable, args: tuple, queue) -> None:
    import torch
    import torch.distributed as dist

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if backend == "gloo":
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(threads)
    try:
        dist.init_process_group(backend, init_method=f"file://{store_file}", rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=timeout_s))
        result = fn(*args)
        # No rank may tear down while a peer still reads the store.
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
    store_dir = tempfile.mkdtemp(prefix="hybrid-run-local-")
    store_file = os.path.join(store_dir, "store")
    procs = [ctx.Process(target=_entry,
                         args=(r, world_size, store_file, backend, timeout_s, threads, fn, args, queue),
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
        shutil.rmtree(store_dir, ignore_errors=True)
    return [results[r] for r in range(world_size)]
