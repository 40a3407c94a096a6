"""Ask every Ray node what GPUs and host memory it has: one task pinned to each node runs
``hybrid.plan.monitor.probe()`` and reads the host memory (``host_memory_bytes``: ``MemAvailable`` of
``/proc/meminfo``, what the node can give a job now; else the physical memory from ``sysconf``) and, given
the cluster's ``nvme_path``, the free bytes of the disk under it (``launch.planning.nvme_space.disk_space``:
where NVMe offload's swap files go; or why it cannot hold them).

``probe_nodes(nvme_path=None)`` returns one ``NodeReport`` per alive Ray node (node id, IP, logical CPU/GPU
counts, the ``NodeProbe`` NVML gave, or its reason for giving nothing, the host memory, None where unknown,
and the NVMe path's free bytes or problem).
The tasks take no CPU, so they run even where ranks already hold every CPU.

``hybrid probe`` (below: ``measure_rank`` on every rank actor, ``summarize``, ``run_probe``, ``write_probe``,
``read_probe``) measures the links and compute rates the time model otherwise takes from its tables and
writes them to ``run_dir/probe.json``.
"""

from __future__ import annotations

import os
import time
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
# ``hybrid probe`` measures what the time model (hybrid.plan.cost) otherwise takes from its tables: on every
# rank actor at once (``RankWorker.probe`` -> ``measure_rank``), all-reduces and all-gathers through
# ``hybrid.comm.Comm`` (the path training takes: gloo, shared memory on one host, NCCL on GPUs) over the
# intra-node groups (a node's ranks) and the inter-node groups (one rank per node, the same local rank), at a
# small and a large size; then a matmul in the training precision and a fused AdamW step. All nodes' groups
# run together, as in training, so shared links and cores are measured shared. ``summarize`` (pure) turns the
# ranks' figures into ``probe.json``: per group a line ``seconds = latency + bus bytes / bandwidth`` through
# the two sizes (bus bytes: 2(n-1)/n of the message for an all-reduce, (n-1)/n of the output for an
# all-gather, nccl-tests' convention), the slowest rank's matmul and optimizer rates.

PROBE_VERSION = 1
PROBE_FILE = "probe.json"
SMALL_BYTES = 64 << 10
LARGE_BYTES = {"cpu": 16 << 20, "cuda": 256 << 20}
MATMUL_N = {"cpu": 1024, "cuda": 8192}
OPTIMIZER_NUMEL = 1 << 22
REPS = 5


def _median(values: list) -> float:
    ordered = sorted(values)
    return ordered[len(ordered) // 2]


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time_collective(comm, op: str, nbytes: int, dtype, device) -> float:
    """Median seconds of one ``op`` (all_reduce | all_gather) of ``nbytes`` (the all-gather's output)."""
    import torch

    n = comm.size
    numel = max(n, nbytes // torch.empty((), dtype=dtype).element_size() // n * n)
    full = torch.ones(numel, dtype=dtype, device=device)
    shard = torch.ones(numel // n, dtype=dtype, device=device)

    def once():
        if op == "all_reduce":
            comm.all_reduce(full)
        else:
            comm.all_gather(full, shard)

    once()  # connects the transport (shared memory, NCCL communicators)
    times = []
    for _ in range(REPS):
        comm.barrier()
        _sync(device)
        t0 = time.perf_counter()
        once()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return _median(times)


def _group_figures(comm, dtype, device) -> Optional[dict]:
    if comm is None or comm.size < 2:
        return None
    large = LARGE_BYTES["cuda" if device.type == "cuda" else "cpu"]
    return {"size": comm.size, **{op: [[b, _time_collective(comm, op, b, dtype, device)] for b in (SMALL_BYTES, large)]
                                  for op in ("all_reduce", "all_gather")}}


def _matmul_rate(dtype, device) -> float:
    import torch

    n = MATMUL_N["cuda" if device.type == "cuda" else "cpu"]
    a, b = torch.randn(n, n, device=device).to(dtype), torch.randn(n, n, device=device).to(dtype)
    a @ b
    times = []
    for _ in range(3):
        _sync(device)
        t0 = time.perf_counter()
        a @ b
        _sync(device)
        times.append(time.perf_counter() - t0)
    return 2 * n ** 3 / _median(times)


def _optimizer_rate(device) -> float:
    """Parameters per second a fused (else foreach) AdamW steps over fp32 values on ``device``."""
    import torch

    p = torch.nn.Parameter(torch.zeros(OPTIMIZER_NUMEL, device=device))
    p.grad = torch.ones_like(p)
    try:
        opt = torch.optim.AdamW([p], fused=True)
        opt.step()
    except (RuntimeError, ValueError):
        opt = torch.optim.AdamW([p], foreach=True)
        opt.step()
    times = []
    for _ in range(REPS):
        _sync(device)
        t0 = time.perf_counter()
        opt.step()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return OPTIMIZER_NUMEL / _median(times)


def measure_rank(rank: int, world_size: int, ranks_per_node: int, device: str, precision: str) -> dict:
    """This rank's figures (see above); every rank of the default group calls it together."""
    import torch
    import torch.distributed as dist

    from hybrid.comm.collectives import Comm

    dev = torch.device(device)
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    nodes, g = world_size // ranks_per_node, ranks_per_node
    node, local = rank // g, rank % g
    # every rank creates every group, in one order, as torch.distributed requires
    intra = [dist.new_group(list(range(n * g, (n + 1) * g))) for n in range(nodes)]
    inter = [dist.new_group([n * g + j for n in range(nodes)]) for j in range(g)]
    figures = {"rank": rank, "node": node, "local_rank": local,
               "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"}
    figures["intra"] = _group_figures(Comm(intra[node], "probe-intra") if g > 1 else None, dtype, dev)
    figures["inter"] = _group_figures(Comm(inter[local], "probe-inter") if nodes > 1 else None, dtype, dev)
    dist.barrier()
    figures["matmul_flops"] = _matmul_rate(dtype, dev)
    dist.barrier()
    figures["optimizer_rate"] = _optimizer_rate(dev)
    for group in intra + inter:
        dist.destroy_process_group(group)
    return figures


def fit_line(points: list) -> tuple[float, float]:
    """``(latency s, bandwidth bytes/s)`` of ``seconds = latency + bus_bytes / bandwidth`` through two
    ``(bus_bytes, seconds)`` points; a larger message that was not slower gives the large one's rate and
    no latency."""
    (b0, t0), (b1, t1) = sorted(points)[:2]
    if t1 <= t0 or b1 <= b0:
        return 0.0, b1 / t1
    bandwidth = (b1 - b0) / (t1 - t0)
    return max(0.0, t0 - b0 / bandwidth), bandwidth


def _bus_bytes(op: str, nbytes: float, n: int) -> float:
    return (2 if op == "all_reduce" else 1) * (n - 1) / n * nbytes


def summarize(ranks: list, nodes: int, gpus_per_node: int, precision: str, address: str = "") -> dict:
    """``probe.json``: each group's fitted line, the slowest rank's rates, and every rank's raw figures.
    Bandwidth is the bus bandwidth per rank, the mean of the all-reduce's and all-gather's fits; latency the
    all-reduce's (the small all-reduces of TP are what it prices)."""
    out = {"version": PROBE_VERSION, "made": time.strftime("%Y-%m-%d %H:%M:%S"), "address": address,
           "nodes": nodes, "gpus_per_node": gpus_per_node, "precision": precision,
           "device": ranks[0]["device"] if ranks else "cpu",
           "matmul_flops": {precision: min(r["matmul_flops"] for r in ranks)},
           "optimizer_rate": min(r["optimizer_rate"] for r in ranks)}
    for key, concurrent in (("intra", nodes), ("inter", gpus_per_node)):
        groups = [r[key] for r in ranks if r.get(key)]
        if not groups:
            out[key] = None
            continue
        n = groups[0]["size"]
        fits = {}
        for op in ("all_reduce", "all_gather"):
            sizes = [b for b, _ in groups[0][op]]
            slowest = [(_bus_bytes(op, b, n), max(dict(map(tuple, grp[op]))[b] for grp in groups)) for b in sizes]
            latency, bandwidth = fit_line(slowest)
            fits[op] = {"points": [[b, t] for (_, t), b in zip(slowest, sizes)], "latency": latency,
                        "bandwidth": bandwidth}
        out[key] = {"group_size": n, "concurrent_groups": concurrent, **fits,
                    "bandwidth": (fits["all_reduce"]["bandwidth"] + fits["all_gather"]["bandwidth"]) / 2,
                    "latency": fits["all_reduce"]["latency"]}
    out["ranks"] = ranks
    return out


def run_probe(spec, use_gpus: bool, timeout_s: Optional[float] = None) -> dict:
    """Start the job's rank actors on the connected cluster, measure (``measure_rank`` on every rank at once)
    and stop them; the ``summarize``d figures. The actors start as a job's do (its runtime env, placement and
    rendezvous), without its working directory: the probe runs no user code."""
    import shutil
    import tempfile

    from launch.ray.runtime_env import rank_env
    from launch.ray.workers import WorkerGroup

    c = spec.cluster
    timeout_s = timeout_s or spec.job.collective_timeout_s
    shared_dir = tempfile.mkdtemp(prefix="hybrid-probe-") if c.is_local else None
    group = WorkerGroup(c.nodes, c.gpus_per_node, use_gpus, env=rank_env(spec), shared_dir=shared_dir)
    try:
        group.start(spec.job.placement_timeout_s)
        group.setup(1, timeout_s)
        ranks = ray.get([a.probe.remote(spec.parallel.precision) for a in group.actors], timeout=timeout_s + 120)
    finally:
        group.shutdown()
        if shared_dir is not None:
            shutil.rmtree(shared_dir, ignore_errors=True)
    return summarize(ranks, c.nodes, c.gpus_per_node, spec.parallel.precision, c.address)


def write_probe(run_dir, figures: dict) -> Path:
    """``run_dir/probe.json``, written atomically; its path."""
    import json

    path = Path(run_dir) / PROBE_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(figures, indent=2))
    os.replace(tmp, path)
    return path


def read_probe(run_dir, spec=None) -> Optional[dict]:
    """``run_dir/probe.json`` when there is one made for this cluster's shape (nodes, ranks per node,
    precision), else None. A file that cannot be read or parsed is a ``ConfigError`` naming it."""
    import json

    from hybrid.errors import ConfigError
    from hybrid.config.yamlfile import read_regular_file

    path = Path(run_dir) / PROBE_FILE
    if not path.exists():
        return None
    text = read_regular_file(path, str(path), "run hybrid probe again")
    try:
        figures = json.loads(text)
        if not isinstance(figures, dict) or figures.get("version") != PROBE_VERSION:
            raise ValueError(f"not a version-{PROBE_VERSION} probe file")
        for key in ("matmul_flops", "optimizer_rate", "nodes", "gpus_per_node"):
            if key not in figures:
                raise ValueError(f"it has no {key}")
    except ValueError as err:
        raise ConfigError(f"{path} is unreadable ({err}); run hybrid probe again.") from None
    if spec is not None and (figures["nodes"], figures["gpus_per_node"], figures.get("precision")) != \
            (spec.cluster.nodes, spec.cluster.gpus_per_node, spec.parallel.precision):
        return None
    return figures
