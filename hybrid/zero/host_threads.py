"""How many threads an offloaded optimizer steps with on the host: the rank's share of its node's cores.

Rank processes run with one intra-op thread (``OMP_NUM_THREADS=1``: a GPU rank's host work is launching
kernels, and CPU ranks share the cores), but an offloaded optimizer's step is host compute over the rank's
whole shard, so it runs with ``host_optimizer_threads``: ``zero.offload_optimizer.threads`` when set, else the
node's cores divided among its ranks (torchrun's ``LOCAL_WORLD_SIZE``, which ``launch`` and ``run_local``
set), at least one. ``intra_op_threads`` sets that around the step and restores the rank's own count after.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from typing import Mapping, Optional

import torch


def host_optimizer_threads(configured: Optional[int], cores: int, ranks_on_node: int) -> int:
    """``configured`` when set, else ``cores // ranks_on_node`` (at least 1)."""
    if configured is not None:
        return int(configured)
    return max(1, int(cores) // max(1, int(ranks_on_node)))


def node_cores() -> int:
    """Cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # no affinity call on this platform
        return os.cpu_count() or 1


def ranks_on_node(env: Optional[Mapping] = None) -> int:
    """The job's ranks on this node (``LOCAL_WORLD_SIZE``; 1 when not launched by torchrun or ``hybrid``)."""
    env = os.environ if env is None else env
    return max(1, int(env.get("LOCAL_WORLD_SIZE", "1")))


@contextmanager
def intra_op_threads(n: int):
    """torch's intra-op thread count set to ``n`` inside the block, the previous count restored after."""
    before = torch.get_num_threads()
    if n != before:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        if n != before:
            torch.set_num_threads(before)
