"""``hybrid plan cluster.yaml [--json] [--measured RUN_DIR]``: the model's measured size, the mesh (and why
this TP degree), the per-stage memory table with the complete prediction, the levers tried (activation
checkpointing, optimizer offload with its host bytes), the chosen ZeRO stage and levers, with the reason,
and for the built-in GPT the layouts that fit ranked by predicted tokens/s (``launch.planning.time_plan``:
each cost term, step time, MFU; the fastest is the plan) with one reason sentence that names the numbers.

Plans from the declared facts of the cluster file alone (``cluster.gpu_memory_gb``); it never starts or
contacts Ray, so it runs anywhere, and the output says so. Below the planner's table it shows the complete
per-rank prediction of every stage (``launch.job.memory_view.prediction_lines``: model states, buckets and
gathered units in flight, optimizer step copies, activations, runtime reserve). ``--measured RUN_DIR``
re-plans from what a finished or failed run measured: its ``probe.json`` (``hybrid probe``: links and compute
rates instead of the tables), its ``time.json`` (the measured step time of the layout it ran calibrates the
compute efficiency, ``hybrid.plan.cost.calibrate``, and the layouts are re-ranked) and its ``memory.json``
(the measured peak beyond that run's prediction is added to every candidate,
``launch.planning.replan.from_measured``); any of them, at least one. ``--json`` prints one JSON
object (``launch.planning.plan.plan_dict`` with ``prediction`` and, with ``--measured``, ``measured``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import sys
from pathlib import Path
from typing import Optional

import click

from launch.planning import replan
from launch.job.memory_view import prediction_lines
from launch.planning.model_size import model_facts
from launch.planning.plan import build_plan, format_plan, human_bytes, plan_dict
from launch.spec import load_spec


@click.command("plan")
@click.argument("cluster_file", type=click.Path(dir_okay=False))
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of text.")
@click.option("--measured", "run_dir", type=click.Path(file_okay=False), default=None,
              help="Re-plan from what a run measured (its run_dir: memory.json, time.json, probe.json).")
def plan_command(cluster_file: str, as_json: bool, run_dir: Optional[str]) -> None:
    """Show how CLUSTER_FILE would run: ranks per node, TP and DP groups, memory per ZeRO stage, the layouts
    ranked by predicted tokens/s, and the chosen one."""
    # With --json, stdout is the one JSON object: what the user's model module prints when it is imported to
    # count its parameters goes to stderr.
    with contextlib.redirect_stdout(sys.stderr) if as_json else contextlib.nullcontext():
        spec = load_spec(cluster_file)
        facts = model_facts(spec)
        found = _run_records(spec, run_dir) if run_dir else {}
        plan = build_plan(spec, facts=facts, probe=found.get("probe"))
        timing = _calibration(plan, found.get("time"), run_dir) if found.get("time") else None
        if timing is not None and timing["factor"] != 1.0:
            plan = build_plan(spec, facts=facts, probe=found.get("probe"), calibration=timing["factor"])
        stages = {s: replan.predict(plan, replan.Choice(s, plan.micro_batch, plan.accumulation)) for s in range(4)}
        measured = _measured(plan, run_dir) if "memory" in found else None
        start = replan.start_note(plan)
    if as_json:
        out = {**plan_dict(plan), "prediction": {str(s): p.as_dict() for s, p in stages.items()},
               "start": dataclasses.asdict(replan.initial_choice(plan)), "start_note": start}
        if measured is not None:
            out["measured"] = measured
        if timing is not None:
            out["calibration"] = timing
        if found.get("probe") is not None:
            out["probe"] = {"run_dir": run_dir, "made": found["probe"].get("made")}
        click.echo(json.dumps(out, indent=2))
        return
    click.echo(format_plan(plan))
    for line in prediction_lines(stages, replan.usable_bytes(plan), replan.device_of(plan)):
        click.echo(line)
    if start is not None:
        click.echo(f"launch  {start}")
    if found.get("probe") is not None:
        click.echo(f"measured {run_dir}: links and compute rates from its probe.json ({found['probe'].get('made')})")
    for note in found.get("notes", []):
        click.echo(f"measured {run_dir}: {note}")
    if timing is not None:
        click.echo(timing["line"])
    if measured is not None:
        click.echo(measured["line"])


def _run_records(spec, run_dir: str) -> dict:
    """What ``run_dir`` holds for the re-plan: ``probe`` (probe.json made for this cluster's shape), ``time``
    (time.json) and ``memory`` (memory.json, read by ``_measured``). None of them: ``memory_loop.load``'s
    error, which names memory.json."""
    from launch.job.metrics import TIME_FILE
    from launch.planning.memory_loop import MEMORY_FILE, load
    from launch.planning.probe_figures import PROBE_FILE, read_probe

    found, notes = {}, []
    probe = read_probe(run_dir, spec)
    if probe is not None:
        found["probe"] = probe
    elif (Path(run_dir) / PROBE_FILE).exists():
        notes.append(f"its {PROBE_FILE} was made for another cluster shape or precision: not used")
    if (Path(run_dir) / TIME_FILE).exists():
        found["time"] = _load_time(Path(run_dir) / TIME_FILE, run_dir)
    if (Path(run_dir) / MEMORY_FILE).exists() or not found:
        load(run_dir)  # a missing or bad memory.json is one sentence here, before anything is planned
        found["memory"] = True
    found["notes"] = notes
    return found


def _load_time(path: Path, run_dir: str) -> dict:
    from hybrid.config import validate as v
    from hybrid.config.yamlfile import read_regular_file
    from hybrid.errors import ConfigError

    text = read_regular_file(path, f"--measured {run_dir}: {path}", "give the run_dir of a finished job")
    try:
        record = json.loads(text)
        layout = v.mapping("layout", record["layout"])
        for key in ("nodes", "gpus_per_node", "tp", "stage", "micro_batch", "accumulation"):
            v.positive_int(f"layout.{key}", layout[key]) if key != "stage" else v.stage("layout.stage", layout[key])
        v.positive_number("measured_step_s", record["measured_step_s"])
    except (ValueError, KeyError, TypeError, ConfigError) as err:
        raise ConfigError(f"--measured {run_dir}: {path} lacks or garbles a field ({err}); give the run_dir of a "
                          "job launched with this version") from None
    return record


def _calibration(plan, record: dict, run_dir: str) -> Optional[dict]:
    """The compute-efficiency factor that makes the time model predict what the run's layout measured
    (``hybrid.plan.cost.calibrate``), with the sentence saying so; None without a time model."""
    from hybrid.plan.cost import Layout, calibrate, step_cost

    tm = plan.time
    if tm is None or tm.model is None:
        return None
    lay = record["layout"]
    layout = Layout(int(lay["nodes"]), int(lay["gpus_per_node"]), int(lay["tp"]), int(lay["stage"]),
                    int(lay["micro_batch"]), int(lay["accumulation"]), bool(lay.get("activation_checkpointing")),
                    bool(lay.get("offload")), lay.get("precision", plan.spec.parallel.precision))
    predicted = step_cost(tm.model, layout, tm.hardware)
    measured = float(record["measured_step_s"])
    _, factor = calibrate(tm.hardware, predicted, measured)
    line = (f"measured {run_dir}: its layout ({layout.label}) took {measured * 1e3:.3g} ms per step against "
            f"{predicted.step_s * 1e3:.3g} ms predicted; compute efficiency x{factor:.3g} "
            f"({tm.hardware.compute_efficiency:.3g} -> {tm.hardware.compute_efficiency * factor:.3g}), the layouts "
            "re-ranked with it")
    return {"layout": layout.label, "measured_step_s": measured, "predicted_step_s": predicted.step_s,
            "factor": factor, "line": line}


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
