"""Files a job leaves on each node's own disk, removed when it ends: NVMe offload's swap files.

Every rank keeps its optimizer states in ``<cluster.nvme_path>/hybrid-swap-<job id>/rank<r>.swap``
(``hybrid.zero.nvme``) and removes it when its engine closes; a rank killed without that chance (the worker
group killed after a failure, a crash, the OOM killer) leaves it behind, on a disk sized for one set of them.
``remove_swap_files(spec, job_id)`` removes the job's whole swap directory: on the driver for an embedded cluster
(every node is this machine), else with one task pinned to each alive Ray node (no CPU taken, so it runs where
ranks hold every CPU). The driver calls it after every attempt, so that a restarted attempt finds the disk as
the first one did. It never raises: a node it cannot reach is logged, and the directory holds nothing else.
"""

from __future__ import annotations

import logging
import shutil

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from hybrid.plan.swap_layout import swap_dir

log = logging.getLogger(__name__)

CLEANUP_TIMEOUT_S = 60.0


def remove_here(directory: str) -> None:
    shutil.rmtree(directory, ignore_errors=True)


@ray.remote(num_cpus=0)
def _remove_on_node(directory: str) -> None:
    remove_here(directory)


def remove_swap_files(spec, job_id: str, timeout_s: float = CLEANUP_TIMEOUT_S) -> None:
    """Remove job ``job_id``'s swap directory under ``cluster.nvme_path`` from every node (see the module
    docstring); nothing without an NVMe path."""
    if spec.cluster.nvme_path is None:
        return
    directory = str(swap_dir(spec.cluster.nvme_path, job_id))
    if spec.cluster.is_local:
        remove_here(directory)
        return
    try:
        nodes = [n for n in ray.nodes() if n.get("Alive")]
        refs = [_remove_on_node.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False))
                .remote(directory) for n in nodes]
        ray.get(refs, timeout=timeout_s)
    except Exception as err:  # noqa: BLE001 - the job's outcome stands; what is left is said, not raised
        log.warning("could not remove the swap files %s from every node (%s); remove them by hand", directory, err)
