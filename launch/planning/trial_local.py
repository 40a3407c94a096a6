"""The time model's last calibration on an embedded local cluster: a few real steps of the job, timed, before the
plan is printed.

The quick probe (``launch.planning.probe_local``) measures collectives and rates in training's rhythm, which
gives the layouts their order; on CPU ranks that share a few cores it still leaves the step's absolute time
short (a rank waits for its peers' turns on the cores in every collective and every op, more than any
collective-after-compute probe shows). So on an embedded cluster the planned layout is run for ``TRIAL_STEPS``
steps of the job itself: the job's entrypoint on the cluster's world of CPU ranks here
(``hybrid.runtime.local_launch.run_local``, no Ray actors), with the plan's settings, no checkpoint directory
and ``job.steps`` = ``TRIAL_STEPS`` (a loop that does not stop there is asked to stop, ``Context.should_stop``,
once that many steps were reported), and ``step_factor`` is its median step time (the ranks' slowest, after the
first ``WARMUP_STEPS``) over the layout's prediction. ``Hardware.slowed`` then makes every layout's predicted
step that much longer (``launch.planning.time_plan``: the probe figures' ``step_factor``): the ranking stays
the model's, the absolute time this machine's.

A trial that fails or does not finish within ``TRIAL_TIMEOUT_S`` leaves the prediction as it was, with a
warning (the job itself will say what went wrong, and a calibration never stops a job); so does a job that
reports no step times.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Optional

log = logging.getLogger(__name__)

TRIAL_STEPS, WARMUP_STEPS = 8, 3
TRIAL_TIMEOUT_S = 90.0


def _trial_rank(entrypoint: str, working_dir: Optional[str], model_config_path: str, settings, tp: int,
                timeout_s: float) -> list:
    """One rank of the trial: the entrypoint on a Context of the plan's settings; the step times it reported."""
    from datetime import timedelta

    import torch.distributed as dist
    import yaml

    from hybrid.comm.mesh import build_mesh
    from hybrid.runtime.train import Context
    from launch.spec import resolve_entrypoint

    mesh = build_mesh(tp, timeout=timedelta(seconds=timeout_s))
    fn = resolve_entrypoint(entrypoint, working_dir=working_dir, check_shadowing=False)
    with open(model_config_path) as f:
        model_config = yaml.safe_load(f)
    times: list = []

    def reporter(record: dict) -> None:
        if isinstance(record.get("step_time_s"), (int, float)):
            times.append(float(record["step_time_s"]))

    ctx = Context(mesh, model_config, settings, model_config_path=model_config_path, rank=dist.get_rank(),
                  world_size=dist.get_world_size(), device="cpu", reporter=reporter,
                  stop_requested=lambda: len(times) >= settings.steps)
    fn(ctx)
    return times


def trial_settings(settings):
    """The plan's rank settings for a trial: ``TRIAL_STEPS`` steps, nothing saved, memory measured once."""
    return dataclasses.replace(settings, steps=TRIAL_STEPS, checkpoint_dir=None, checkpoint_every=0,
                               checkpoint_every_seconds=None, checkpoint_async=False, measure_every=10**9)


def median_step_s(per_rank: list) -> Optional[float]:
    """The median over steps, after the first ``WARMUP_STEPS``, of the slowest rank's time of each step."""
    steps = min((len(t) for t in per_rank), default=0)
    slowest = [max(t[i] for t in per_rank) for i in range(steps)]
    if len(slowest) > WARMUP_STEPS:
        slowest = slowest[WARMUP_STEPS:]
    if not slowest:
        return None
    return sorted(slowest)[len(slowest) // 2]


def run_trial(spec, settings, tp: int) -> Optional[dict]:
    """``{"step_s", "steps", "seconds"}`` of the trial of ``settings`` at TP ``tp`` on ``spec``'s embedded
    cluster, or None (with a warning) where it gave no figure."""
    from hybrid.runtime.local_launch import LocalRunError, run_local

    job = spec.job
    started = time.perf_counter()
    try:
        per_rank = run_local(_trial_rank, spec.cluster.world_size, job.entrypoint,
                             str(job.working_dir) if job.working_dir else None, str(job.config),
                             trial_settings(settings), tp, TRIAL_TIMEOUT_S, timeout_s=TRIAL_TIMEOUT_S)
    except (LocalRunError, OSError, TimeoutError) as err:
        last = [line for line in str(err).splitlines() if line.strip()][-1:] or [type(err).__name__]
        log.warning("the calibration trial did not finish (%s); the step time is predicted without it",
                    last[0].strip()[:300])
        return None
    step_s = median_step_s(per_rank)
    if step_s is None:
        log.warning("the calibration trial reported no step times (the entrypoint's loop reports none through "
                    "ctx.report); the step time is predicted without it")
        return None
    return {"step_s": step_s, "steps": min(len(t) for t in per_rank), "seconds": time.perf_counter() - started}


def step_factor(trial: dict, predicted_step_s: float) -> float:
    """What every predicted step is multiplied by: the trial's measured step over the layout's prediction."""
    return trial["step_s"] / predicted_step_s


def trial_line(trial: Optional[dict], predicted_step_s: Optional[float], layout: str) -> str:
    if trial is None or not predicted_step_s:
        return "trial   the calibration trial gave no step time (see the warning above); times as the probe predicts"
    return (f"trial   {trial['steps']} steps of {layout} here in {trial['seconds']:.1f} s: "
            f"{trial['step_s'] * 1e3:.3g} ms per step against {predicted_step_s * 1e3:.3g} ms predicted from the "
            f"probe; every layout's time below x{step_factor(trial, predicted_step_s):.3g}")
