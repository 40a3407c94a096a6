"""``hybrid plan cluster.yaml [--json] [--measured RUN_DIR]``: the model's measured size, the mesh (and why
this TP degree), the per-stage memory table with the complete prediction, the levers tried (activation
checkpointing, optimizer offload with its host bytes) and the chosen ZeRO stage and levers, with the reason.

Plans from the declared facts of the cluster file alone (``cluster.gpu_memory_gb``); it never starts or
contacts Ray, so it runs anywhere, and the output says so. Below the planner's table it shows the complete
per-rank prediction of every stage (``launch.job.memory_view.prediction_lines``: model states, buckets and
gathered units in flight, optimizer step copies, activations, runtime reserve). ``--measured RUN_DIR``
re-plans from what a finished or failed run measured (its ``memory.json``): the measured peak beyond that
run's prediction is added to every candidate (``launch.planning.replan.from_measured``). ``--json`` prints one JSON
object (``launch.planning.plan.plan_dict`` with ``prediction`` and, with ``--measured``, ``measured``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import sys
from typing import Optional

import click

from launch.planning import replan
from launch.job.memory_view import prediction_lines
from launch.planning.plan import build_plan, format_plan, human_bytes, plan_dict
from launch.spec import load_spec


@click.command("plan")
@click.argument("cluster_file", type=click.Path(dir_okay=False))
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of text.")
@click.option("--measured", "run_dir", type=click.Path(file_okay=False), default=None,
              help="Re-plan from the memory a run measured (its run_dir, holding memory.json).")
def plan_command(cluster_file: str, as_json: bool, run_dir: Optional[str]) -> None:
    """Show how CLUSTER_FILE would run: ranks per node, TP and DP groups, memory per ZeRO stage, chosen stage."""
    # With --json, stdout is the one JSON object: what the user's model module prints when it is imported to
    # count its parameters goes to stderr.
    with contextlib.redirect_stdout(sys.stderr) if as_json else contextlib.nullcontext():
        plan = build_plan(load_spec(cluster_file))
        stages = {s: replan.predict(plan, replan.Choice(s, plan.spec.job.micro_batch)) for s in range(4)}
        measured = _measured(plan, run_dir) if run_dir else None
        start = replan.start_note(plan)
    if as_json:
        out = {**plan_dict(plan), "prediction": {str(s): p.as_dict() for s, p in stages.items()},
               "start": dataclasses.asdict(replan.initial_choice(plan)), "start_note": start}
        if measured is not None:
            out["measured"] = measured
        click.echo(json.dumps(out, indent=2))
        return
    click.echo(format_plan(plan))
    for line in prediction_lines(stages, replan.usable_bytes(plan), replan.device_of(plan)):
        click.echo(line)
    if start is not None:
        click.echo(f"launch  {start}")
    if measured is not None:
        click.echo(measured["line"])


def _measured(plan, run_dir: str) -> dict:
    from launch.planning.memory_loop import load

    from hybrid.errors import PlanError

    record = load(run_dir)  # every field from_measured reads is checked there
    try:
        choice, prediction, over = replan.from_measured(plan, record)
    except replan.NothingFits as err:  # here a finding about the plan, not a job that failed
        raise PlanError(f"--measured {run_dir}: {err}") from None
    line = (f"measured {run_dir}: rank {over.rank} peaked at {human_bytes(over.measured)} (predicted "
            f"{human_bytes(over.predicted)}, {human_bytes(over.extra)} beyond it); re-planned with that: "
            f"{choice.describe()} needs {human_bytes(prediction.total + over.extra)} of "
            f"{human_bytes(replan.usable_bytes(plan))} usable")
    return {"run_dir": run_dir, "rank": over.rank, "measured_bytes": over.measured, "predicted_bytes": over.predicted,
            "extra_bytes": over.extra, "choice": dataclasses.asdict(choice), "prediction": prediction.as_dict(),
            "line": line}
