"""Ask every Ray node what GPUs and host memory it has: one task pinned to each node runs
``hybrid.plan.monitor.probe()`` and reads the host memory (``host_memory_bytes``: ``MemAvailable`` of
``/proc/meminfo``, what the node can give a job now; else the physical memory from ``sysconf``) and, given
the cluster's ``nvme_path``, the free bytes of the disk under it (``launch.planning.nvme_space.disk_space``:
where NVMe offload's swap files go; or why it cannot hold them).

``probe_nodes(nvme_path=None)`` returns one ``NodeReport`` per alive Ray node (node id, IP, logical CPU/GPU
counts, the ``NodeProbe`` NVML gave, or its reason for giving nothing, the host memory, None where unknown,
and the NVMe path's free bytes or problem).
The tasks take no CPU, so they run even where ranks already hold every CPU.

``hybrid probe``'s measurement of the links and compute is elsewhere: ``hybrid.runtime.probe.measure_rank`` (in
each rank), ``launch.ray.rank_probe.run_probe`` (the rank actors) and ``launch.planning.probe_figures``
(``probe.json``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from hybrid.plan.monitor import NodeProbe

PROBE_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class NodeReport:
    node_id: str
    ip: str
    cpus: float  # logical CPUs Ray schedules on this node
    gpus: float  # GPUs Ray schedules on this node
    probe: NodeProbe  # what NVML measured there
    host_memory_bytes: Optional[int] = None  # what the node's host memory can give the job; None: unknown
    nvme_free_bytes: Optional[int] = None  # free bytes under cluster.nvme_path; None: not asked, or unusable
    nvme_problem: Optional[str] = None  # why cluster.nvme_path cannot hold swap files there (a file, not writable)

    @property
    def measured(self) -> bool:
        return self.probe.available and bool(self.probe.gpus)


def parse_meminfo(text: str) -> Optional[int]:
    """Bytes of ``MemAvailable`` (else ``MemTotal``) in the text of ``/proc/meminfo``; None if neither."""
    fields = {}
    for line in text.splitlines():
        name, _, rest = line.partition(":")
        parts = rest.split()
        if parts and parts[0].isdigit():
            fields[name.strip()] = int(parts[0]) * (1024 if parts[1:] == ["kB"] else 1)
    return fields.get("MemAvailable", fields.get("MemTotal"))


def host_memory_bytes(meminfo: Path = Path("/proc/meminfo")) -> Optional[int]:
    """This machine's host memory available to a job, in bytes; None where it cannot be read."""
    try:
        found = parse_meminfo(meminfo.read_text())
    except OSError:
        found = None
    if found is None:
        try:
            found = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (AttributeError, OSError, ValueError):
            return None
    return found


@ray.remote(num_cpus=0)
def _probe_here(nvme_path: Optional[str] = None) -> tuple:
    from hybrid.plan.monitor import probe
    from launch.planning.nvme_space import disk_space

    return probe(), host_memory_bytes(), (disk_space(nvme_path) if nvme_path else (None, None))


def live_nodes() -> list[dict]:
    """``ray.nodes()`` of the connected cluster that are alive."""
    return [n for n in ray.nodes() if n.get("Alive")]


def probe_nodes(timeout_s: float = PROBE_TIMEOUT_S, nvme_path=None) -> list[NodeReport]:
    """Probe every alive node of the connected Ray cluster, in a stable order (by IP, then node id); with
    ``nvme_path`` (``cluster.nvme_path``) each node also measures the free bytes of its disk there."""
    nodes = sorted(live_nodes(), key=lambda n: (n["NodeManagerAddress"], n["NodeID"]))
    path = str(nvme_path) if nvme_path is not None else None
    refs = [_probe_here.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False))
            .remote(path) for n in nodes]
    probes = ray.get(refs, timeout=timeout_s)
    return [NodeReport(node_id=n["NodeID"], ip=n["NodeManagerAddress"], cpus=n["Resources"].get("CPU", 0.0),
                       gpus=n["Resources"].get("GPU", 0.0), probe=p, host_memory_bytes=host,
                       nvme_free_bytes=disk[0], nvme_problem=disk[1])
            for n, (p, host, disk) in zip(nodes, probes)]


# ------------------------------------------------------------------------------- links and compute rates
#
# ``hybrid probe``'s links and compute rates are measured on every rank actor (``RankWorker.probe`` ->
# ``hybrid.runtime.probe.measure_rank``) and fitted into ``probe.json`` by ``launch.planning.probe_figures``,
# whose docstring says what is measured and how.
