"""Whether this machine can host an embedded Ray cluster of a given shape, and why not.

``address: local`` starts one raylet per declared node and one Python process (torch loaded) per rank,
all on this machine. ``embedded_limit_error(nodes, ranks_per_node, cpus, memory_bytes)`` is the pure
rule; ``check_embedded`` applies it to this machine and raises ``ConfigError`` naming ``cluster.nodes``
or ``cluster.gpus_per_node``, the limit and the reason. It runs before any Ray process starts, so a
``nodes: 100000`` typo never begins spawning raylets.
"""

from __future__ import annotations

import os
from typing import Optional

from hybrid.errors import ConfigError

RANKS_PER_CPU = 4  # ranks of a toy job mostly wait on each other; more than this just thrashes
MIN_RANKS = 8  # what the shipped demos and tests need, even on a 1-core runner
NODES_PER_CPU = 2  # each embedded node is a raylet with its own threads
MIN_NODES = 4
NODE_BYTES = 300 * 10**6  # raylet + its object store (launch.ray.cluster caps it at 100 MiB)
RANK_BYTES = 500 * 10**6  # a rank's Python process with torch imported, before any model


def embedded_limit_error(nodes: int, ranks_per_node: int, cpus: int, memory_bytes: Optional[int]) -> Optional[str]:
    """One sentence when ``nodes`` × ``ranks_per_node`` cannot run on ``cpus`` cores and ``memory_bytes``
    of memory (None: unknown, not checked); None when it can."""
    max_nodes = max(MIN_NODES, NODES_PER_CPU * cpus)
    if nodes > max_nodes:
        return (f"cluster.nodes is {nodes}, but an embedded cluster (address: local) runs every node on this "
                f"machine and its {cpus} CPU{'s' if cpus != 1 else ''} host at most {max_nodes}; lower "
                "cluster.nodes, or start Ray on real nodes and use address: auto")
    ranks = nodes * ranks_per_node
    max_ranks = max(MIN_RANKS, RANKS_PER_CPU * cpus)
    if ranks > max_ranks:
        return (f"cluster.gpus_per_node is {ranks_per_node}, so {nodes} x {ranks_per_node} = {ranks} ranks would "
                f"run on this machine's {cpus} CPU{'s' if cpus != 1 else ''}, which host at most {max_ranks}; "
                "lower cluster.gpus_per_node or cluster.nodes")
    if memory_bytes is not None:
        need = nodes * NODE_BYTES + ranks * RANK_BYTES
        if need > memory_bytes:
            return (f"cluster.nodes is {nodes} with {ranks_per_node} ranks each, which needs about "
                    f"{need / 10**9:.1f} GB before any model, but this machine has {memory_bytes / 10**9:.1f} GB; "
                    "lower cluster.nodes or cluster.gpus_per_node")
    return None


def machine() -> tuple[int, Optional[int]]:
    """This machine's usable CPU count and physical memory in bytes (None where unknown)."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    try:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, OSError, ValueError):
        memory = None
    return cpus, memory


def check_embedded(nodes: int, ranks_per_node: int) -> None:
    """Raise ``ConfigError`` unless this machine can host the embedded cluster."""
    error = embedded_limit_error(nodes, ranks_per_node, *machine())
    if error:
        raise ConfigError(error + ".")
