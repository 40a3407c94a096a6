"""``hybrid plan cluster.yaml [--json]``: the model's measured size, the mesh (and why this TP degree), the
per-stage memory table, the levers tried (activation checkpointing, optimizer offload with its host bytes)
and the chosen ZeRO stage and levers, with the reason.

Plans from the declared facts of the cluster file alone (``cluster.gpu_memory_gb``); it never starts or
contacts Ray, so it runs anywhere, and the output says so. ``--json`` prints one JSON object
(``launch.plan.plan_dict``).
"""

from __future__ import annotations

import json

import click

from launch.plan import build_plan, format_plan, plan_dict
from launch.spec import load_spec


@click.command("plan")
@click.argument("cluster_file", type=click.Path(dir_okay=False))
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of text.")
def plan_command(cluster_file: str, as_json: bool) -> None:
    """Show how CLUSTER_FILE would run: ranks per node, TP and DP groups, memory per ZeRO stage, chosen stage."""
    plan = build_plan(load_spec(cluster_file))
    if as_json:
        click.echo(json.dumps(plan_dict(plan), indent=2))
    else:
        click.echo(format_plan(plan))
