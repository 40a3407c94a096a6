"""``hybrid launch cluster.yaml [--steps N] [--stage S]``: run the job the cluster file describes.

``--steps`` and ``--stage`` override ``job.steps`` and ``parallel.zero_stage``. Exit status: 0 when every
rank finished, 2 for a problem the user can fix (bad cluster file, model that cannot fit), 1 when the job
failed while running (one ``error:`` sentence; the rank's traceback is in the log above it), 130 on Ctrl-C
or SIGTERM. Every actor is killed and an embedded Ray cluster torn down in all cases. ``--help`` lists the
codes.
"""

from __future__ import annotations

import logging
from typing import Optional

import click

from launch.cli import EXIT_FAILED
from launch.spec import load_spec


@click.command("launch")
@click.argument("cluster_file", type=click.Path(dir_okay=False))
@click.option("--steps", type=int, default=None, help="Override job.steps.")
@click.option("--stage", type=click.IntRange(0, 3), default=None, help="Force ZeRO stage 0-3 (overrides "
              "parallel.zero_stage).")
def launch_command(cluster_file: str, steps: Optional[int], stage: Optional[int]) -> None:
    """Train on the Ray cluster CLUSTER_FILE names (address: local starts an embedded one).

    \b
    Exit status:
      0    every rank finished
      1    the job failed while running (the error line names the rank and cause)
      2    a problem you can fix: bad cluster file or option, no Ray cluster, model that cannot fit
      130  interrupted by Ctrl-C (SIGINT) or SIGTERM; every Ray process started is stopped
    """
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    spec = load_spec(cluster_file).with_overrides(steps=steps, stage=stage)
    from launch.job import JobFailed, launch  # imports Ray: only for this command

    try:
        launch(spec)
    except JobFailed as err:
        click.echo(f"error: {err}", err=True)
        raise click.exceptions.Exit(EXIT_FAILED)
