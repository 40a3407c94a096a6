"""``hybrid probe cluster.yaml [--json]``: measure what the time model otherwise takes from its tables.

Connects to (or starts) the cluster as ``hybrid launch`` does, starts the job's rank actors and has every rank
measure at once (``hybrid.runtime.probe.measure_rank``): all-reduce and all-gather at a small and a large size
inside each node and across nodes, through the collectives training uses, and a matmul and a fused AdamW
step on its device. Writes ``run_dir/probe.json`` (``launch.planning.probe_figures.summarize``), prints the figures and
the hardware the plan then uses (``hybrid.plan.hardware.build_hardware``). ``hybrid plan --measured
RUN_DIR`` and ``hybrid launch`` of the same cluster file (whose ``job.run_dir`` holds it) plan from it.
Takes a few seconds beyond starting the actors. Exit status as ``hybrid launch``'s: 2 for a problem the user
can fix, 130 interrupted.
"""

from __future__ import annotations

import json
import logging
import sys
import time

import click

from hybrid.config.units import human_bytes
from launch.commands.launch import require_ray
from launch.spec import load_spec


@click.command("probe")
@click.argument("cluster_file", type=click.Path(dir_okay=False))
@click.option("--json", "as_json", is_flag=True, help="Print probe.json's figures as one JSON object.")
def probe_command(cluster_file: str, as_json: bool) -> None:
    """Measure CLUSTER_FILE's links and compute rates on its rank actors; write run_dir/probe.json."""
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    spec = load_spec(cluster_file)
    require_ray()
    figures, path = probe_cluster(spec, sys.stderr if as_json else sys.stdout)
    if as_json:
        click.echo(json.dumps({k: v for k, v in figures.items() if k != "ranks"}, indent=2))
        return
    for line in probe_lines(figures):
        click.echo(line)
    from launch.planning.time_plan import hardware_for

    hw = hardware_for(spec, figures["device"], figures)
    click.echo("plan    " + "; ".join(f"{k} {v}" for k, v in hw.sources))
    click.echo(f"wrote {path}: hybrid plan --measured {path.parent} plans from it, and hybrid launch {cluster_file} "
               "reads it from its run_dir")


def probe_cluster(spec, stream) -> tuple[dict, object]:
    """Connect, probe the nodes (NVML: are there GPUs), measure on the rank actors, write probe.json."""
    from launch.job.driver import kept_logs_dir
    from launch.planning.plan import _memory_from_probes
    from launch.ray import cluster as ray_cluster
    from launch.planning.probe_figures import write_probe
    from launch.ray.probe import probe_nodes
    from launch.ray.rank_probe import run_probe
    from launch.ray.runtime_env import client_runtime_env

    print(f"probing {spec.cluster.nodes} nodes x {spec.cluster.gpus_per_node} ranks ({spec.cluster.address})",
          file=stream, flush=True)
    with ray_cluster.connect(spec.cluster, keep_logs=kept_logs_dir(spec),
                             client_runtime_env=client_runtime_env(spec)) as connected:
        print(connected.line(), file=stream, flush=True)
        use_gpus = _memory_from_probes(spec, probe_nodes())[0]
        started = time.perf_counter()
        figures = run_probe(spec, use_gpus)
        figures["seconds"] = time.perf_counter() - started
    return figures, write_probe(spec.job.run_dir, figures)


def probe_lines(figures: dict) -> list[str]:
    """The figures as text: one line per group, then the rates."""
    lines = [f"probe   {figures['nodes']} nodes x {figures['gpus_per_node']} ranks on {figures['device']} "
             f"({figures['precision']}), {figures.get('seconds', 0):.1f} s"]
    for key, name in (("intra", "intra-node"), ("inter", "inter-node")):
        g = figures.get(key)
        if not g:
            lines.append(f"  {name}: no group of 2 or more ranks")
            continue
        ops = "; ".join(f"{op.replace('_', '-')} " + ", ".join(f"{human_bytes(b)} {t * 1e3:.3g} ms"
                                                                for b, t in g[op]["points"])
                        for op in ("all_reduce", "all_gather"))
        lines.append(f"  {name} (groups of {g['group_size']}, {g['concurrent_groups']} at once): {ops}; "
                     f"{g['bandwidth'] / 1e9:.3g} GB/s bus bandwidth per rank, {g['latency'] * 1e6:.0f} us latency")
    rate = next(iter(figures["matmul_flops"].values()))
    lines.append(f"  matmul {rate / 1e9:.4g} GFLOP/s, AdamW {figures['optimizer_rate'] / 1e6:.4g}M parameters/s "
                 "(the median rank's; CPU ranks at their share of their host's cores)")
    return lines
