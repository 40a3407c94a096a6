"""``hybrid monitor``: what NVML reports for this node's GPUs, or why it cannot (exit status 0 either way)."""

from __future__ import annotations

import json

import click

from hybrid.plan.monitor import probe


def _gb(value: int) -> str:
    return f"{value / 10**9:.1f} GB"


@click.command("monitor")
@click.option("--json", "as_json", is_flag=True, help="Print the probe as one JSON object.")
def monitor(as_json: bool) -> None:
    """Show each GPU of this node (name, memory, utilization) as NVML reports it."""
    result = probe()
    if as_json:
        click.echo(json.dumps(result.as_dict()))
        return
    if not result.available:
        click.echo(f"no NVML: {result.reason}")
        return
    click.echo(result.reason)
    for gpu in result.gpus:
        busy = "n/a" if gpu.utilization is None else f"{gpu.utilization:g}%"
        click.echo(
            f"GPU {gpu.index}: {gpu.name}, {_gb(gpu.used_bytes)} used / {_gb(gpu.total_bytes)} total "
            f"({_gb(gpu.free_bytes)} free), utilization {busy}"
        )
