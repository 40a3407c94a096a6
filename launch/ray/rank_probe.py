"""``hybrid probe`` on a connected cluster: the job's rank actors started as a job's are, each measuring its
links and compute at once (``hybrid.runtime.probe.measure_rank``), then stopped; the figures summarized
(``launch.planning.probe_figures``)."""

from __future__ import annotations

from typing import Optional

import ray

from launch.planning.probe_figures import summarize


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
