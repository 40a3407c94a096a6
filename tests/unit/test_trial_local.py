"""The calibration trial's arithmetic (``launch.planning.trial_local``): which step time it takes, what it runs."""

import pytest

from hybrid.runtime.train import JobSettings
from launch.planning.trial_local import (TRIAL_STEPS, WARMUP_STEPS, median_step_s, step_factor, trial_line,
                                         trial_settings)


def test_the_trial_takes_the_slowest_rank_of_each_step_after_the_warmup():
    fast = [1.0, 0.9, 0.8, 0.010, 0.011, 0.012, 0.013, 0.014]
    slow = [1.5, 1.0, 0.9, 0.020, 0.011, 0.030, 0.013, 0.016]
    assert WARMUP_STEPS == 3
    assert median_step_s([fast, slow]) == 0.016  # of 0.020, 0.011, 0.030, 0.013, 0.016
    assert median_step_s([fast[:2]]) == 1.0  # too few steps: all of them
    assert median_step_s([[], fast]) is None and median_step_s([]) is None


def test_the_trial_runs_the_plans_settings_for_a_few_steps_and_saves_nothing():
    settings = JobSettings(steps=1000, micro_batch=8, stage=2, checkpoint_dir="/runs/x", checkpoint_every=10,
                           checkpoint_every_seconds=60.0, checkpoint_async=True, activation_checkpointing=True,
                           gradient_accumulation_steps=2)
    trial = trial_settings(settings)
    assert trial.steps == TRIAL_STEPS and trial.checkpoint_dir is None and not trial.checkpoint_async
    assert trial.checkpoint_every == 0 and trial.checkpoint_every_seconds is None
    assert (trial.stage, trial.micro_batch, trial.activation_checkpointing, trial.gradient_accumulation_steps) == \
        (2, 8, True, 2)


def test_the_factor_and_the_line():
    trial = {"step_s": 0.05, "steps": 8, "seconds": 4.2}
    assert step_factor(trial, 0.025) == pytest.approx(2.0)
    line = trial_line(trial, 0.025, "tp2 z1 mb 8")
    assert line == ("trial   8 steps of tp2 z1 mb 8 here in 4.2 s: 50 ms per step against 25 ms predicted from the "
                    "probe; every layout's time below x2")
    assert "gave no step time" in trial_line(None, 0.025, "tp2 z1 mb 8")
