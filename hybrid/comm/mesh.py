"""The 2D process mesh: data parallel (across nodes) × tensor parallel (inside a node).

``build_mesh(tp, dp=None)`` turns the initialized default process group into a ``("dp", "tp")``
``DeviceMesh`` with TP innermost: ranks ``k·tp … k·tp+tp−1`` form one TP group, ranks with the same
``rank % tp`` form one DP group (launchers put consecutive ranks on one node, so a TP group never
straddles nodes). The ZeRO engine runs on ``dp_group`` over each rank's local (TP-sliced) parameters; the
TP layers talk over ``tp_comm``. Both groups get their own ``Comm`` so the TP traffic and the DP traffic
are counted separately. The dp and tp groups are created with ``new_group`` and the default group's full
backend (``DeviceMesh.from_group`` then wraps them): ``init_device_mesh`` would split an eagerly initialized
NCCL group with ``ncclCommSplit``, which on some torch versions yields NCCL-only groups where a CPU tensor
has no backend. They get the ``timeout`` given, else torch's default. The mesh's device type follows the
default group (``cuda`` when it was bound to a
GPU or has an NCCL backend, else ``cpu``); ``node_index`` and ``local_rank`` are where the rank really
runs, as torchrun and the Ray launcher state it (``GROUP_RANK``/``NODE_RANK``, ``LOCAL_RANK``), not
``rank // tp``: with tp smaller than the ranks per node those differ. ``build_mesh`` exchanges every rank's
``node_index`` once (``hybrid.comm.groups.group_nodes``) so that ``dp_comm`` and ``tp_comm`` count their bytes
per link (intra- and inter-node, ``hybrid.plan.links``); ``nodes`` holds them, by global rank.

``init_default_group(device, ...)`` is the one place a rank joins the default group: on CUDA it binds the
device and uses ``"cpu:gloo,cuda:nccl"``, so collectives on CPU tensors (metrics, ``full_state_dict()``)
keep working beside NCCL on GPU tensors.

``build_mesh`` warns (on rank 0) when torchrun's ``LOCAL_WORLD_SIZE`` puts a TP group on several nodes (a
``tp`` that does not divide the ranks per node): it still trains, but the TP
all-reduces of every layer then cross the inter-node network. ``hybrid launch`` refuses such a plan.

``MeshLayout`` (the one definition of which ranks form each group, also what ``hybrid plan`` prints),
``mesh_degrees``, ``placement_from_env`` (defined in ``hybrid.comm.groups``, which ``group_nodes`` reads it
from) and ``tp_groups_across_nodes`` are pure, usable before any process exists.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Mapping, Optional

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from hybrid.comm.collectives import Comm
from hybrid.comm.groups import group_nodes, placement_from_env  # noqa: F401  (this module's name for it too)
from hybrid.errors import ConfigError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class MeshLayout:
    """Which global ranks form each group, before any process exists: rank r runs on node r // ranks_per_node;
    TP groups are tp consecutive ranks (inside a node when tp divides ranks_per_node), DP groups the ranks with
    equal r % tp. ``build_mesh`` creates these groups; ``hybrid plan`` prints them."""

    nodes: int
    ranks_per_node: int
    tp: int
    dp: int

    @classmethod
    def of(cls, nodes: int, ranks_per_node: int, tp: int) -> "MeshLayout":
        """The layout of ``nodes`` x ``ranks_per_node`` ranks in TP groups of ``tp`` (a divisor of the node)."""
        if ranks_per_node % tp:
            raise ConfigError(f"parallel.tp is {tp}, which does not divide cluster.gpus_per_node = {ranks_per_node}; "
                              "use a divisor of gpus_per_node.")
        return cls(nodes, ranks_per_node, tp, nodes * ranks_per_node // tp)

    @property
    def node_ranks(self) -> list[list[int]]:
        g = self.ranks_per_node
        return [list(range(n * g, (n + 1) * g)) for n in range(self.nodes)]

    @property
    def tp_groups(self) -> list[list[int]]:
        return [list(range(k * self.tp, (k + 1) * self.tp)) for k in range(self.dp)]

    @property
    def dp_groups(self) -> list[list[int]]:
        return [list(range(j, self.tp * self.dp, self.tp)) for j in range(self.tp)]


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
    node_index: int   # the node this rank runs on (GROUP_RANK / NODE_RANK)
    local_rank: int   # the rank's index among this job's ranks on its node (LOCAL_RANK)
    nodes: tuple = ()  # the node of every global rank


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


def tp_groups_across_nodes(node_of_rank: list, tp: int) -> list:
    """``(ranks, nodes)`` of every TP group (consecutive ranks ``k·tp … k·tp+tp−1``) whose ranks run on more
    than one node, given each global rank's node index."""
    out = []
    for k in range(0, len(node_of_rank), tp):
        ranks = list(range(k, min(k + tp, len(node_of_rank))))
        nodes = sorted({node_of_rank[r] for r in ranks})
        if len(nodes) > 1:
            out.append((ranks, nodes))
    return out


def _warn_if_tp_crosses_nodes(env: Mapping[str, str], world: int, tp: int) -> None:
    """A warning on rank 0 when torchrun's ``LOCAL_WORLD_SIZE`` (ranks per node, consecutive ranks on one
    node) puts a TP group on several nodes. Read from the environment, not exchanged: a collective here would
    need the rank's CUDA device set before ``build_mesh``."""
    if tp == 1 or "LOCAL_WORLD_SIZE" not in env or dist.get_rank() != 0:
        return
    per_node = int(env["LOCAL_WORLD_SIZE"])
    crossing = tp_groups_across_nodes([r // per_node for r in range(world)], tp)
    if crossing:
        ranks, on = crossing[0]
        log.warning("tp=%d puts TP group ranks %s on nodes %s (%d TP group(s) span nodes): every TP all-reduce "
                    "then crosses the inter-node network; choose a tp that divides the ranks per node (%d here)",
                    tp, ranks, on, len(crossing), per_node)


def process_group_backend(device: torch.device) -> str:
    """The default group's backend for a rank on ``device``: NCCL for CUDA tensors with gloo beside it for
    CPU tensors, gloo alone on CPU."""
    return "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"


def init_default_group(device: torch.device, rank: int, world_size: int, timeout: timedelta,
                       store: Optional[dist.Store] = None, init_method: Optional[str] = None) -> None:
    """Join the default process group as ``rank`` on ``device`` (a CUDA device is made current and bound,
    so NCCL creates its communicator on it and never guesses ``cuda:0``)."""
    kwargs = {}
    if device.type == "cuda":
        torch.cuda.set_device(device)
        kwargs["device_id"] = device
        for key in ("TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE"):  # NCCL's flight-recorder dumps
            folder = os.path.dirname(os.environ.get(key, ""))
            if folder:
                os.makedirs(folder, exist_ok=True)
    dist.init_process_group(process_group_backend(device), store=store, init_method=init_method, rank=rank,
                            world_size=world_size, timeout=timeout, **kwargs)


def default_device_type() -> str:
    """``cuda`` when the default group was bound to a GPU or runs NCCL, else ``cpu``."""
    bound = getattr(dist.group.WORLD, "bound_device_id", None)
    if bound is not None:
        return bound.type
    return "cuda" if "nccl" in str(dist.get_backend()).lower() else "cpu"


def _mesh_groups(grid: torch.Tensor, timeout: Optional[timedelta]) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """This rank's (dp, tp) groups of ``grid`` (dp × tp global ranks); every rank creates every group, in the
    same order, as ``new_group`` requires."""
    rank, backend = dist.get_rank(), dist.get_backend()
    mine = {}
    for name, rows in (("tp", grid.tolist()), ("dp", grid.t().tolist())):
        for ranks in rows:
            group = dist.new_group(ranks, timeout=timeout, backend=backend)
            if rank in ranks:
                mine[name] = group
    return mine["dp"], mine["tp"]


def build_mesh(tp: int, dp: Optional[int] = None, device_type: Optional[str] = None,
               timeout: Optional[timedelta] = None) -> HybridMesh:
    """Build the (dp, tp) mesh over the initialized default process group (every rank must call this);
    ``device_type`` defaults to the default group's (``default_device_type``), ``timeout`` to torch's."""
    if not dist.is_initialized():
        raise RuntimeError("build_mesh needs an initialized default process group (dist.init_process_group).")
    rank, world = dist.get_rank(), dist.get_world_size()
    dp, tp = mesh_degrees(world, tp, dp)
    device_type = device_type or default_device_type()
    node_index, local_rank = placement_from_env(os.environ, rank)
    _warn_if_tp_crosses_nodes(os.environ, world, tp)
    # the groups depend on tp and dp alone (where each rank runs is node_index, from the environment)
    grid = torch.tensor(MeshLayout(1, world, tp, dp).tp_groups, dtype=torch.int)  # dp x tp: rows TP, columns DP
    dp_group, tp_group = _mesh_groups(grid, timeout)
    device_mesh = DeviceMesh.from_group([dp_group, tp_group], device_type, mesh=grid, mesh_dim_names=("dp", "tp"))
    nodes = group_nodes(None)  # where every rank runs, so each comm counts its bytes per link
    return HybridMesh(
        device_mesh=device_mesh,
        dp_group=dp_group,
        tp_group=tp_group,
        dp_comm=Comm(dp_group, name="dp", nodes=[nodes[r] for r in dist.get_process_group_ranks(dp_group)]),
        tp_comm=Comm(tp_group, name="tp", nodes=[nodes[r] for r in dist.get_process_group_ranks(tp_group)]),
        dp_rank=device_mesh.get_local_rank("dp"),
        tp_rank=device_mesh.get_local_rank("tp"),
        dp=dp,
        tp=tp,
        node_index=node_index,
        local_rank=local_rank,
        nodes=nodes,
    )
