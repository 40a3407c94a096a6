"""Run a function on N local ranks with a real process group (gloo on CPU, nccl on CUDA).

Used by the multi-process tests and the benchmarks; the production launcher is Ray (``launch/``).
``run_local(fn, world_size, *args)`` spawns ``world_size`` processes, initializes the default process
group through a file store in a private temporary directory, calls ``fn(*args)`` on each, and returns
the per-rank results in rank order. A failure on any rank raises ``LocalRunError`` carrying that rank's
traceback; the other ranks are terminated, never left behind.

Every rank gets torchrun's variables for one node (RANK, WORLD_SIZE, LOCAL_RANK = rank, LOCAL_WORLD_SIZE,
GROUP_RANK = NODE_RANK = 0). With ``backend="nccl"`` rank r runs on ``cuda:r`` (``rank_device``; more ranks
than GPUs is an error, as NCCL cannot put two ranks of one group on one GPU) and joins a
``"cpu:gloo,cuda:nccl"`` group bound to that device (``hybrid.comm.mesh.init_default_group``).

Ranks are forked from a forkserver that has imported torch and the engine once (where the platform has one;
spawn elsewhere), so a rank starts in milliseconds instead of re-importing torch (seconds on a busy
2-core host, and the tests start hundreds of ranks). Each rank gets the caller's environment as it is at
the call, as a spawned process would, not the one the forkserver started with.

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

from hybrid.errors import ConfigError

BACKENDS = ("gloo", "nccl")
# What the forkserver imports once for every later rank (importing torch does not initialise CUDA).
_PRELOAD = ["torch", "torch.distributed", "hybrid.zero.engine", "hybrid.comm.mesh"]


class LocalRunError(RuntimeError):
    pass


def check_backend(backend: str) -> None:
    if backend not in BACKENDS:
        raise ConfigError(f"backend is {backend!r}; use one of {', '.join(BACKENDS)}.")


def rank_device(rank: int, world_size: int, backend: str, device_count: int) -> str:
    """The device rank ``rank`` of a one-node run uses: ``cuda:rank`` with nccl (one GPU per rank), else cpu."""
    check_backend(backend)
    if backend == "gloo":
        return "cpu"
    if world_size > device_count:
        raise ConfigError(f"backend nccl needs one GPU per rank, but world_size is {world_size} and this "
                          f"machine has {device_count} GPU(s); run at most {device_count} ranks or use gloo.")
    return f"cuda:{rank}"


def local_rank_env(rank: int, world_size: int) -> dict:
    """torchrun's variables for rank ``rank`` of ``world_size`` ranks on one node."""
    return dict(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size),
                GROUP_RANK="0", NODE_RANK="0")


def preload(*modules: str) -> None:
    """Have the forkserver import ``modules`` too, once for every later rank (e.g. the transformers models a
    test suite's ranks build). Effective before the first ``run_local`` of this process, which starts the
    forkserver; a module that fails to import is left to the ranks."""
    _PRELOAD.extend(m for m in modules if m not in _PRELOAD)


def _context():
    """A forkserver context preloading torch where the platform has one, else spawn (never fork: the
    caller may hold threads, CUDA, or a gloo group)."""
    if "forkserver" in mp.get_all_start_methods():
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(_PRELOAD)
        return ctx
    return mp.get_context("spawn")


def _entry(rank: int, world_size: int, store_file: str, backend: str, timeout_s: float, threads: int,
           fn: Callable, args: tuple, queue, environ: dict) -> None:
    os.environ.clear()
    os.environ.update(environ)
    import torch
    import torch.distributed as dist

    from hybrid.comm.mesh import init_default_group

    os.environ.update(local_rank_env(rank, world_size))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # gloo serves CPU tensors under nccl too
    torch.set_num_threads(threads)
    try:
        count = torch.cuda.device_count() if backend == "nccl" else 0
        device = torch.device(rank_device(rank, world_size, backend, count))
        init_default_group(device, rank, world_size, timedelta(seconds=timeout_s),
                           init_method=f"file://{store_file}")
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
    check_backend(backend)  # the GPU count is checked in each rank: the parent must not initialize CUDA
    ctx = _context()
    queue = ctx.Queue()
    store_dir = tempfile.mkdtemp(prefix="hybrid-run-local-")
    store_file = os.path.join(store_dir, "store")
    procs = [ctx.Process(target=_entry,
                         args=(r, world_size, store_file, backend, timeout_s, threads, fn, args, queue, dict(os.environ)),
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
