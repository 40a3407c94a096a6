"""Ask every Ray node what GPUs it has: one task pinned to each node runs ``hybrid.monitor.probe()``.

``probe_nodes()`` returns one ``NodeReport`` per alive Ray node (node id, IP, logical CPU/GPU counts,
and the ``NodeProbe`` NVML gave, or its reason for giving nothing). The tasks take no CPU, so they run
even where ranks already hold every CPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from hybrid.monitor import NodeProbe

PROBE_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class NodeReport:
    node_id: str
    ip: str
    cpus: float  # logical CPUs Ray schedules on this node
    gpus: float  # GPUs Ray schedules on this node
    probe: NodeProbe  # what NVML measured there

    @property
    def measured(self) -> bool:
        return self.probe.available and bool(self.probe.gpus)


@ray.remote(num_cpus=0)
def _probe_here() -> NodeProbe:
    from hybrid.monitor import probe

    return probe()


def probe_nodes(timeout_s: float = PROBE_TIMEOUT_S) -> list[NodeReport]:
    """Probe every alive node of the connected Ray cluster, in a stable order (by IP, then node id)."""
    nodes = sorted((n for n in ray.nodes() if n.get("Alive")), key=lambda n: (n["NodeManagerAddress"], n["NodeID"]))
    refs = [_probe_here.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False))
            .remote() for n in nodes]
    probes = ray.get(refs, timeout=timeout_s)
    return [NodeReport(node_id=n["NodeID"], ip=n["NodeManagerAddress"], cpus=n["Resources"].get("CPU", 0.0),
                       gpus=n["Resources"].get("GPU", 0.0), probe=p)
            for n, p in zip(nodes, probes)]
