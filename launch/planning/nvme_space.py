"""The disk behind NVMe offload: how much a node has for the swap files, and the check before a job starts.

``cluster.nvme_path`` is a directory on each node's local disk where every rank keeps its swap file
(``hybrid.zero.nvme``; ``<nvme_path>/hybrid-swap-<job id>/rank<r>.swap``). ``disk_space(path)`` is what one
machine has there: the free bytes of the filesystem holding it (its nearest existing ancestor: the ranks
create it), and why it cannot be used (a file in the way, not writable) -- the probe runs it on every node
(``launch.ray.probe``), the driver on its own machine for an embedded cluster.

``nvme_space(spec, reports)`` is a node's space for the planner (``choose_stage``'s ``nvme_bytes``), and where the
figure came from: the smallest probed node's free bytes (Ray nodes of one machine share its disk), else the
declared ``cluster.nvme_gb``, else, for an embedded cluster, the driver's own disk shared by its nodes, else
None (not checked).

``check_nvme_space(lp, reports)``, before the ranks start: where the plan keeps the optimizer states on NVMe,
every machine must hold the swap files of all the ranks it runs -- each rank's file exactly as the store lays
it out (``hybrid.plan.swap_layout.swap_file_bytes`` of its shard, with a record boundary's padding allowed per
unit) -- or the job is refused with one sentence naming the path, the machine, the bytes needed and the bytes
free (``PlanError``, exit 2), instead of a full disk when the ranks preallocate.
"""

from __future__ import annotations

import tempfile
from collections import Counter
from pathlib import Path
from typing import Optional, Sequence

from hybrid.config.units import human_bytes
from hybrid.errors import PlanError
from hybrid.plan.memory import GB
from hybrid.plan.swap_layout import ADAM_FIELDS, ALIGN, swap_file_bytes


def disk_space(path) -> tuple[Optional[int], Optional[str]]:
    """``(free bytes, None)`` of the filesystem that holds (or will hold) ``path``, or ``(None, why)`` where it
    cannot hold the swap files: a file in the way, a directory the job may not write in."""
    import shutil

    path = Path(path)
    existing = path
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        return None, f"{existing} is a file"
    try:
        with tempfile.TemporaryFile(dir=existing):
            pass
        return shutil.disk_usage(existing).free, None
    except OSError as err:
        return None, f"{existing} is not writable ({err.strerror or err})"


def nvme_space(spec, reports: Optional[Sequence]) -> tuple[Optional[float], str]:
    """A node's space for the swap files under ``cluster.nvme_path`` and where the figure came from (see the
    module docstring); ``(None, "")`` without an NVMe path."""
    cluster = spec.cluster
    if cluster.nvme_path is None:
        return None, ""
    path = cluster.nvme_path
    if reports and all(getattr(r, "nvme_free_bytes", None) is not None for r in reports):
        sharing = Counter(r.ip for r in reports)
        share = {r.node_id: r.nvme_free_bytes / sharing[r.ip] for r in reports}
        smallest = min(reports, key=lambda r: share[r.node_id])
        shared = (f", shared by the {sharing[smallest.ip]} Ray nodes at {smallest.ip}"
                  if sharing[smallest.ip] > 1 else "")
        return share[smallest.node_id], (f"NVMe space probed: {human_bytes(share[smallest.node_id])} free under {path} "
                                         f"per node (smallest node{shared})")
    if cluster.nvme_gb is not None:
        return cluster.nvme_gb * GB, f"NVMe space declared: cluster.nvme_gb = {cluster.nvme_gb:g} GB per node"
    if cluster.is_local:
        free, _ = disk_space(path)
        if free is not None:
            return free / cluster.nodes, (f"NVMe space measured here: {human_bytes(free)} free under {path}, shared "
                                          f"by the {cluster.nodes} local node{'s' if cluster.nodes > 1 else ''}")
    return None, f"NVMe space under {path} unknown (declare cluster.nvme_gb to check it when planning offline)"


def swap_bytes_per_rank(lp) -> int:
    """The bytes of one rank's swap file at the plan's stage: its shard as the engine lays it out, cut into
    ``zero.sub_group_size`` records (``swap_file_bytes``), plus one record boundary's padding per unit (the
    optimizer's sub-groups may break at a unit's edge). The shard is of the plan's shard group
    (``zero.shard_group``: all the DP ranks, or fewer)."""
    from hybrid.plan.memory import shard_topology, unit_layout
    from launch.planning.replan import units_of, zero_config

    zero = zero_config(lp, lp.stage)
    units = units_of(lp, zero)
    shard = shard_topology(lp.layout.dp, lp.stage, zero, max(1, lp.spec.cluster.gpus_per_node // lp.layout.tp)).shard
    layout, _ = unit_layout(units, lp.stage, shard, lp.spec.parallel.precision, zero.reduce_bucket_size,
                            zero.param_persistence_threshold)
    return swap_file_bytes(layout.shard_numel, zero.sub_group_size, ADAM_FIELDS) + ALIGN * len(layout.units)


def check_nvme_space(lp, reports: Optional[Sequence]) -> None:
    """Refuse to start a job whose ranks' swap files do not fit a machine's disk (see the module docstring)."""
    if not lp.plan.nvme:
        return
    spec = lp.spec
    path = spec.cluster.nvme_path
    if path is None:  # the plan chose NVMe, which needs the directory (auto only weighs it with one)
        raise PlanError("the plan offloads the optimizer states to NVMe, but cluster.nvme_path is not set; set it "
                        "to a directory on each node's local NVMe disk.")
    per_rank = swap_bytes_per_rank(lp)
    ranks = spec.cluster.gpus_per_node
    if spec.cluster.is_local or not reports:
        machines = [("this machine", ranks * spec.cluster.nodes, *disk_space(path))] if spec.cluster.is_local else []
    else:
        # every probed machine may get ranks (as for host memory): up to its Ray nodes' worth, at most the job's
        sharing = Counter(r.ip for r in reports)
        machines = [(f"node {ip}", ranks * min(count, spec.cluster.nodes),
                     *_probed(next(r for r in reports if r.ip == ip))) for ip, count in sharing.items()]
    for where, n_ranks, free, problem in machines:
        need = per_rank * n_ranks
        if problem is not None:
            raise PlanError(f"cluster.nvme_path {path} cannot hold the optimizer states' swap files on {where}: "
                            f"{problem}; point it at a writable directory on the local NVMe disk.")
        if free is not None and need > free:
            raise PlanError(f"cluster.nvme_path {path} has {human_bytes(free)} free on {where}, but the optimizer "
                            f"states offloaded to NVMe need {human_bytes(need)} there ({n_ranks} ranks x "
                            f"{human_bytes(per_rank)}); free space there, point cluster.nvme_path at a larger disk, "
                            "or use more nodes.")


def _probed(report) -> tuple[Optional[int], Optional[str]]:
    return getattr(report, "nvme_free_bytes", None), getattr(report, "nvme_problem", None)
