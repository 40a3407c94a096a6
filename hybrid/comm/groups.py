"""Where a group's ranks run, and the sub-groups of a group (node-local, across nodes, shard and replica groups).

``group_nodes(group, device)`` is the node of each rank of ``group`` (in group rank order), as each rank's
environment states it (``placement_from_env``, pure: torchrun's and the Ray launcher's ``GROUP_RANK``
/ ``NODE_RANK`` / ``LOCAL_WORLD_SIZE``; simulated nodes on one host count as nodes), exchanged once over the
group: a collective (one all-gather of an integer, on ``device``: the CPU where the group's backend has gloo,
else the current CUDA device), so every rank of ``group`` calls it.

``subgroup(ranks)`` is a process group of the global ``ranks``, created by those ranks alone
(``new_group(use_local_synchronization=True)``: the ranks outside it need not take part, so an engine can cut its
DP group without the rest of the world) with the default group's backend, and kept for the process: the same
ranks get the same group again (an engine made twice does not create its groups twice). Every member must
create its sub-groups in the same order (``hybrid.zero.sharding`` creates them kind by kind), as
``new_group`` requires. A group whose default group has been destroyed is made anew.
"""

from __future__ import annotations

import os
from typing import Mapping, Optional, Sequence

import torch
import torch.distributed as dist

_GROUPS: dict = {}  # (id of the default group, ranks) -> process group


def placement_from_env(env: Mapping[str, str], rank: int) -> tuple[int, int]:
    """``(node_index, local_rank)`` of ``rank`` from torchrun-style variables.

    ``LOCAL_RANK`` is the rank's index on its node; the node is ``GROUP_RANK`` (torchrun) or ``NODE_RANK``,
    else derived from ``LOCAL_WORLD_SIZE`` (ranks per node, consecutive ranks per node). Without any of
    them the job is taken to be one node: ``(0, rank)``.
    """
    if "LOCAL_RANK" not in env:
        return 0, rank
    local_rank = int(env["LOCAL_RANK"])
    for key in ("GROUP_RANK", "NODE_RANK"):
        if key in env:
            return int(env[key]), local_rank
    if "LOCAL_WORLD_SIZE" in env:
        return (rank - local_rank) // int(env["LOCAL_WORLD_SIZE"]), local_rank
    return 0, local_rank


def group_nodes(group: Optional[dist.ProcessGroup] = None, device=None) -> tuple:
    """The node index of every rank of ``group`` (``None``: the default group), in group rank order
    (collective over ``group``; ``device``: where the exchanged integer lives, see the module docstring)."""
    if not (dist.is_available() and dist.is_initialized()):
        return (0,)
    node, _ = placement_from_env(os.environ, dist.get_rank())
    size = dist.get_world_size(group)
    if size == 1:
        return (node,)
    if device is None:
        gloo = "gloo" in str(dist.get_backend(group)).lower()
        device = torch.device("cpu") if gloo else torch.device("cuda", torch.cuda.current_device())
    mine = torch.tensor([node], dtype=torch.int64, device=device)
    out = [torch.empty_like(mine) for _ in range(size)]
    dist.all_gather(out, mine, group=group)
    return tuple(int(n.item()) for n in out)


def global_ranks(group: Optional[dist.ProcessGroup]) -> list:
    """The global ranks of ``group`` in group rank order (``None``: the default group)."""
    if group is None:
        return list(range(dist.get_world_size()))
    return list(dist.get_process_group_ranks(group))


def subgroup(ranks: Sequence[int]) -> dist.ProcessGroup:
    """The process group of the global ``ranks`` (sorted), created by its members only, kept for the process."""
    ranks = tuple(sorted(int(r) for r in ranks))
    key = (id(dist.group.WORLD), ranks)
    group = _GROUPS.get(key)
    if group is not None and _alive(group):
        return group
    group = dist.new_group(list(ranks), backend=dist.get_backend(), use_local_synchronization=True)
    _GROUPS[key] = group
    return group


def _alive(group) -> bool:
    try:
        dist.get_process_group_ranks(group)
    except (RuntimeError, ValueError, KeyError):
        return False
    return True
