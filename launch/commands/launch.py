"""``hybrid launch cluster.yaml [--steps N] [--stage S] [--probe]``: run the job the cluster file describes.

``--steps`` and ``--stage`` override ``job.steps`` and ``parallel.zero_stage``; ``--probe`` measures the links
and compute rates on the rank actors first (``hybrid probe``) and plans from them. Exit status: 0 when every
rank finished, 2 for a problem the user can fix (bad cluster file, model that cannot fit), 1 when the job
failed while running (one ``error:`` sentence; the rank's traceback is in the log above it), 130 on Ctrl-C
or SIGTERM. Every actor is killed and an embedded Ray cluster torn down in all cases. ``--help`` lists the
codes.

Only this command needs Ray: without it (not installed, or failing to import) it says so in one ``error:``
sentence and exits 2, while ``estimate``, ``plan``, ``checkpoint``, ``data`` and ``monitor`` keep working and
the library trains under ``torchrun`` as before.
"""

from __future__ import annotations

import logging
from typing import Optional

import click

from hybrid.errors import UserError, first_line
from launch.exit_codes import EXIT_FAILED
from launch.job.log_forwarding import no_dedup
from launch.spec import load_spec


class RayMissing(UserError):
    """``hybrid launch`` was run where Ray cannot be imported."""


def require_ray() -> None:
    """Import Ray, or raise ``RayMissing`` (one sentence: what needs it, how to install it, what runs without)."""
    no_dedup()  # Ray reads it when imported
    try:
        import ray  # noqa: F401
    except ImportError as err:
        raise RayMissing(f"hybrid launch needs Ray, which cannot be imported here ({first_line(err, type(err).__name__)}); install it with "
                         f"`pip install ray`, or run your entrypoint under torchrun, where the library itself "
                         f"needs no Ray.") from None


@click.command("launch")
@click.argument("cluster_file", type=click.Path(dir_okay=False))
@click.option("--steps", type=int, default=None, help="Override job.steps.")
@click.option("--stage", type=click.IntRange(0, 3), default=None, help="Force ZeRO stage 0-3 (overrides "
              "parallel.zero_stage).")
@click.option("--probe", "measure_links", is_flag=True, help="Measure the links and compute rates first (hybrid "
              "probe, a few seconds) and plan from them; without it a probe.json in job.run_dir is used.")
def launch_command(cluster_file: str, steps: Optional[int], stage: Optional[int], measure_links: bool) -> None:
    """Train on the Ray cluster CLUSTER_FILE names (address: local starts an embedded one).

    \b
    Exit status:
      0    every rank finished
      1    the job failed while running (the error line names the rank and cause)
      2    a problem you can fix: bad cluster file or option, no Ray cluster, model that cannot fit
      130  interrupted by Ctrl-C (SIGINT), SIGTERM or SIGHUP; every Ray process started is stopped
    """
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    spec = load_spec(cluster_file).with_overrides(steps=steps, stage=stage)
    require_ray()
    from launch.job.driver import JobFailed, launch  # imports Ray: only for this command

    try:
        launch(spec, measure_links=measure_links)
    except JobFailed as err:
        click.echo(f"error: {err}", err=True)
        raise click.exceptions.Exit(EXIT_FAILED)
