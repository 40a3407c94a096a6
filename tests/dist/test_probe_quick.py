"""The quick calibration probe on real ranks (issue 44): ``launch.planning.probe_local.calibrate_local`` runs an
embedded cluster's world of 2 x 2 CPU ranks here (gloo, run_local), each through
``hybrid.runtime.probe.measure_rank(quick=True)``, and the plan is built from what they measured.

Checked: both kinds of group were timed loaded (two ranks each, two groups at once), every call took some time
and the fitted latency is at least none; the rates the quick probe takes are there and the optimizer's is not (the
table's); the hardware the plan builds takes the measured latencies and rates, and the launch line names them."""

import pytest

from launch.planning.plan import build_plan
from launch.planning.probe_local import calibrate_local, calibration_line
from launch.spec import parse_spec

pytestmark = pytest.mark.slow


def test_the_quick_probe_measures_every_group_loaded_and_the_plan_prices_with_it():
    spec = parse_spec({"cluster": {"address": "local", "nodes": 2, "gpus_per_node": 2, "gpu_memory_gb": 80,
                                   "interconnect": {"intra_node": "loopback", "inter_node": "loopback"}},
                       "job": {"entrypoint": "hybrid.models.gpt:train", "config": "configs/gpt-tiny.yaml",
                               "steps": 5, "micro_batch": 8},
                       "parallel": {"tp": 2, "zero_stage": 1, "precision": "fp32"}}, base_dir=".")
    figures = calibrate_local(spec)
    assert figures["quick"] and figures["seconds"] > 0 and len(figures["ranks"]) == 4
    for key in ("intra", "inter"):
        group = figures[key]
        assert group["loaded"] and group["group_size"] == 2 and group["concurrent_groups"] == 2
        assert all(t > 0 for op in ("all_reduce", "all_gather") for _, t in group[op]["points"])
        assert group["latency"] >= 0 and group["bandwidth"] > 0
    assert figures["optimizer_rate"] is None
    assert figures["matmul_flops"]["fp32"] > 0 and figures["op_rate"] > 0 and figures["memory_bandwidth"] > 0
    hw = build_plan(spec, probe=figures).time.hardware
    assert hw.intra.latency == pytest.approx(figures["intra"]["latency"])
    assert hw.op_overhead == pytest.approx(1 / figures["op_rate"]) and hw.peak_flops == figures["matmul_flops"]["fp32"]
    assert calibration_line(figures).startswith("probe   calibrated on this machine")


def test_a_trial_of_the_planned_layout_sets_every_predicted_step_to_this_machines_level():
    """``launch.planning.trial_local``: the job's own entrypoint for a few steps on the 2 x 2 CPU ranks, then the
    plan again with ``step_factor``: the layout tried predicts what the trial measured, the ranking unchanged."""
    from launch.job.driver import settings_for
    from launch.planning import replan
    from launch.planning.trial_local import TRIAL_STEPS, run_trial, step_factor

    spec = parse_spec({"cluster": {"address": "local", "nodes": 2, "gpus_per_node": 2, "gpu_memory_gb": 80},
                       "job": {"entrypoint": "hybrid.models.gpt:train", "config": "configs/gpt-tiny.yaml",
                               "steps": 500, "micro_batch": 4},
                       "parallel": {"tp": 2, "zero_stage": 1, "precision": "fp32"}}, base_dir=".")
    plan = build_plan(spec)
    choice = replan.initial_choice(plan)
    trial = run_trial(spec, settings_for(plan, choice), plan.layout.tp)
    assert trial is not None and trial["steps"] == TRIAL_STEPS and trial["step_s"] > 0, trial
    before = replan.predicted_cost(plan, choice)
    factor = step_factor(trial, before.step_s)
    again = build_plan(spec, probe={"step_factor": factor, "trial": "a test"})
    after = replan.predicted_cost(again, replan.initial_choice(again))
    assert after.layout == before.layout and after.step_s == pytest.approx(trial["step_s"], rel=1e-9)
    assert [c.layout for c in again.time.ranking.candidates] == [c.layout for c in plan.time.ranking.candidates]
