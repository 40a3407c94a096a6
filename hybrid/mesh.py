"""The 2D process mesh: data parallel (across nodes) × tensor parallel (inside a node).

``build_mesh(tp, dp=None)`` turns the initialized default process group into a ``("dp", "tp")``
``DeviceMesh`` with TP innermost: ranks ``k·tp … k·tp+tp−1`` form one TP group and sit on node ``k``;
ranks with the same ``rank % tp`` form one DP group. The ZeRO engine runs on ``dp_group`` over each rank's
local (TP-sliced) parameters; the TP layers talk over ``tp_comm``. Both groups get their own ``Comm`` so
the TP traffic and the DP traffic are counted separately.

``mesh_degrees`` is the pure validation step, usable before any process exists (planner, launcher).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from hybrid.comm import Comm
from hybrid.errors import ConfigError


@dataclass(frozen=True)
class HybridMesh:
    device_mesh: DeviceMesh
    dp_group: dist.ProcessGroup
    tp_group: dist.ProcessGroup
    dp_comm: Comm
    tp_comm: Comm
    dp_rank: int
    tp_rank: int
    dp: int
    tp: int
    node_index: int   # rank // tp: the node (TP group) this rank belongs to
    local_rank: int   # rank % tp: the rank's position inside its node


def mesh_degrees(world_size: int, tp: int, dp: Optional[int] = None) -> tuple[int, int]:
    """Validate the degrees for ``world_size`` ranks and return ``(dp, tp)``; dp defaults to world // tp."""
    if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
        raise ConfigError(f"tp must be a positive integer, got {tp!r}; set tp to the ranks per node.")
    if dp is None:
        if world_size % tp:
            raise ConfigError(f"tp={tp} does not divide the world size {world_size}; "
                              f"choose a tp that divides {world_size}.")
        dp = world_size // tp
    if not isinstance(dp, int) or isinstance(dp, bool) or dp < 1:
        raise ConfigError(f"dp must be a positive integer, got {dp!r}; leave dp unset to use world_size // tp.")
    if tp * dp != world_size:
        raise ConfigError(f"tp={tp} × dp={dp} = {tp * dp} ranks but the world size is {world_size}; "
                          f"choose tp and dp whose product is {world_size}.")
    return dp, tp


def build_mesh(tp: int, dp: Optional[int] = None, device_type: str = "cpu") -> HybridMesh:
    """Build the (dp, tp) mesh over the initialized default process group (every rank must call this)."""
    if not dist.is_initialized():
        raise RuntimeError("build_mesh needs an initialized default process group (dist.init_process_group).")
    rank, world = dist.get_rank(), dist.get_world_size()
    dp, tp = mesh_degrees(world, tp, dp)
    device_mesh = init_device_mesh(device_type, (dp, tp), mesh_dim_names=("dp", "tp"))
    dp_group, tp_group = device_mesh.get_group("dp"), device_mesh.get_group("tp")
    return HybridMesh(
        device_mesh=device_mesh,
        dp_group=dp_group,
        tp_group=tp_group,
        dp_comm=Comm(dp_group, name="dp"),
        tp_comm=Comm(tp_group, name="tp"),
        dp_rank=device_mesh.get_local_rank("dp"),
        tp_rank=device_mesh.get_local_rank("tp"),
        dp=dp,
        tp=tp,
        node_index=rank // tp,
        local_rank=rank % tp,
    )
