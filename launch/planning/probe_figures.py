"""``probe.json``: the links' and compute's figures ``hybrid probe`` measured, fitted and kept in the run
directory, and read back by the plan (``hybrid plan``, ``hybrid launch``) instead of the hardware tables.

Every rank measured at once (``hybrid.runtime.probe.measure_rank``) all-reduces and all-gathers through
``hybrid.comm.Comm`` (the path training takes: gloo, shared memory on one host, NCCL on GPUs) over the
intra-node groups (a node's ranks) and the inter-node groups (one rank per node, the same local rank), at a
small and a large size; then a matmul in the training precision, a fused AdamW step, the eager op rate and a
copy's memory bandwidth (GPU ranks at once, CPU ranks one at a time). All nodes' groups ran together, as in
training, so shared links are measured shared. ``summarize`` (pure) turns the ranks' figures into
``probe.json``: per group a line ``seconds = latency + bus bytes / bandwidth`` through the two sizes (bus
bytes: 2(n-1)/n of the message for an all-reduce, (n-1)/n of the output for an all-gather, nccl-tests'
convention), the median rank's matmul, optimizer, op and memory rates (the slowest rank's times of each
collective: they wait for it; a rate one rank measured low while a daemon took its core is that moment's, not
the rank's), CPU ranks' at their share of their host's cores (``shared_rates``: they were measured one at a
time).
"""

from __future__ import annotations

import os
import time
from collections import Counter
from statistics import median
from pathlib import Path
from typing import Optional

PROBE_VERSION = 1
PROBE_FILE = "probe.json"


def fit_line(points: list) -> tuple[float, float]:
    """``(latency s, bandwidth bytes/s)`` of ``seconds = latency + bus_bytes / bandwidth`` through two
    ``(bus_bytes, seconds)`` points; a larger message that was not slower gives the large one's rate and
    no latency."""
    (b0, t0), (b1, t1) = sorted(points)[:2]
    if t1 <= t0 or b1 <= b0:
        return 0.0, b1 / t1
    bandwidth = (b1 - b0) / (t1 - t0)
    return max(0.0, t0 - b0 / bandwidth), bandwidth


def fit_loaded(points: list) -> tuple[float, float]:
    """``fit_line`` for collectives timed in training's rhythm (``hybrid.runtime.probe._loaded_collective``), where
    a small call is mostly the wait for its peers: a larger message that was not slower gives the large one's rate
    and the small one's time, less its bytes at that rate, as the latency (never none)."""
    (b0, t0), (b1, t1) = sorted(points)[:2]
    if t1 > t0 and b1 > b0:
        return fit_line(points)
    bandwidth = b1 / t1
    return max(0.0, t0 - b0 / bandwidth), bandwidth


def _bus_bytes(op: str, nbytes: float, n: int) -> float:
    return (2 if op == "all_reduce" else 1) * (n - 1) / n * nbytes


def shared_rates(ranks: list, key: str) -> list:
    """Each rank's rate ``key`` as it computes while every rank trains: a CPU rank measured alone (its ``host``
    and ``cores`` given) gets its share of the host's cores, ``cores / ranks on the host`` of its rate when they
    are fewer than the ranks; a GPU rank (measured with the others, a GPU each) keeps its rate."""
    per_host = Counter(r.get("host") for r in ranks)
    return [r[key] * min(1.0, r["cores"] / per_host[r["host"]]) if r.get("host") and r.get("cores") else r[key]
            for r in ranks]


def summarize(ranks: list, nodes: int, gpus_per_node: int, precision: str, address: str = "") -> dict:
    """``probe.json``: each group's fitted line, the median rank's rates, and every rank's raw figures.
    Bandwidth is the bus bandwidth per rank, the mean of the all-reduce's and all-gather's fits; latency the
    all-reduce's (the small all-reduces of TP are what it prices)."""
    out = {"version": PROBE_VERSION, "made": time.strftime("%Y-%m-%d %H:%M:%S"), "address": address,
           "nodes": nodes, "gpus_per_node": gpus_per_node, "precision": precision,
           "device": ranks[0]["device"] if ranks else "cpu",
           "matmul_flops": {precision: median(shared_rates(ranks, "matmul_flops"))},
           "optimizer_rate": median(shared_rates(ranks, "optimizer_rate"))
           if ranks and all(r.get("optimizer_rate") for r in ranks) else None,  # None: the quick probe's
           **{key: median(shared_rates(ranks, key)) for key in ("op_rate", "memory_bandwidth")
              if ranks and all(r.get(key) for r in ranks)}}
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
            loaded = bool(groups[0].get("loaded"))
            latency, bandwidth = (fit_loaded if loaded else fit_line)(slowest)
            fits[op] = {"points": [[b, t] for (_, t), b in zip(slowest, sizes)], "latency": latency,
                        "bandwidth": bandwidth}
        out[key] = {"group_size": n, "concurrent_groups": concurrent, **fits,
                    **({"loaded": True} if groups[0].get("loaded") else {}),
                    "bandwidth": (fits["all_reduce"]["bandwidth"] + fits["all_gather"]["bandwidth"]) / 2,
                    "latency": fits["all_reduce"]["latency"]}
    out["ranks"] = ranks
    return out


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
