"""Gradient accumulation in the training loop: ``run_steps`` / ``train_step`` refuse an engine built with
another ``gradient_accumulation_steps`` than the job's (it silently ran accumulation / engine's value
optimizer steps per step), a step whose rows do not split into the accumulation is a ``UserError`` naming
the fields, and the own-model example builds its engine and batches from the job's accumulation."""

import importlib.util
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import hybrid
from hybrid.errors import UserError
from hybrid.runtime.train import AccumulationMismatch, Context, JobSettings, run_steps, train_step
from tests.launch.test_run_records import Regression

ROOT = Path(__file__).resolve().parents[2]


def _engine(accumulation: int):
    torch.manual_seed(0)
    return hybrid.initialize(Regression(), {"zero_optimization": {"stage": 1}, "precision": "fp32",
                                            "optimizer": {"type": "AdamW", "params": {"lr": 0.01}},
                                            "gradient_accumulation_steps": accumulation})


def _ctx(accumulation: int, steps: int = 4, micro_batch: int = 2) -> Context:
    settings = JobSettings(steps=steps, micro_batch=micro_batch, stage=1, precision="fp32",
                           gradient_accumulation_steps=accumulation)
    return Context(None, {}, settings, reporter=lambda record: None)


def _batch(rows: int):
    x = torch.randn(rows, 4)
    return x, x.sum(1, keepdim=True)


@pytest.mark.parametrize("job, built", [(2, 1), (1, 2), (4, 2)])
def test_run_steps_refuses_an_engine_built_with_another_accumulation(job, built):
    engine = _engine(built)
    fetched = []
    with pytest.raises(AccumulationMismatch) as err:
        run_steps(_ctx(job), engine, lambda step: fetched.append(step) or _batch(4))
    message = str(err.value)
    assert isinstance(err.value, UserError)
    assert f"job.gradient_accumulation_steps is {job}" in message
    assert f"gradient_accumulation_steps = {built}" in message
    assert "training_config(..., accumulation=ctx.settings.gradient_accumulation_steps)" in message
    assert message.count(". ") == 0 and message.endswith(".")  # one sentence
    assert fetched == [] and engine.global_step == 0 and engine.micro_steps == 0  # refused before any work


def test_train_step_refuses_an_accumulation_the_engine_was_not_built_with():
    engine = _engine(2)
    with pytest.raises(AccumulationMismatch, match=r"job\.gradient_accumulation_steps is 1 but the engine's "
                                                   r"config has gradient_accumulation_steps = 2"):
        train_step(engine, *_batch(4))
    assert engine.micro_steps == 0


@pytest.mark.parametrize("accumulation", [1, 2])
def test_a_matching_accumulation_does_one_optimizer_step_per_step(accumulation):
    engine = _engine(accumulation)
    summary = run_steps(_ctx(accumulation), engine, lambda step: _batch(2 * accumulation))
    assert summary["steps"] == 4 and engine.global_step == 4 and engine.micro_steps == 4 * accumulation


def test_rows_that_do_not_split_into_the_accumulation_are_a_user_error_naming_the_fields():
    engine = _engine(3)
    with pytest.raises(AccumulationMismatch) as err:
        run_steps(_ctx(3), engine, lambda step: _batch(8))
    message = str(err.value)
    assert isinstance(err.value, UserError) and isinstance(err.value, ValueError)
    assert "8 rows" in message and "job.gradient_accumulation_steps = 3" in message
    assert "job.micro_batch x job.gradient_accumulation_steps rows per rank" in message
    assert message.count(". ") == 0 and message.endswith(".")
    assert engine.micro_steps == 0


# --- the own-model example: engine and batches from the job's accumulation ---------------------------------

def _own_model():
    spec = importlib.util.spec_from_file_location("own_model_my_model_under_test",
                                                  ROOT / "examples" / "own_model" / "my_model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_own_model_example_steps_once_per_step_on_micro_batch_x_accumulation_rows(monkeypatch):
    my_model = _own_model()
    engines, records, forwards = [], [], []
    initialize = hybrid.initialize

    def recording_initialize(*args, **kwargs):
        engine = initialize(*args, **kwargs)
        engines.append(engine)
        return engine

    monkeypatch.setattr(hybrid, "initialize", recording_initialize)
    model_config = {"model": {"vocab_size": 64, "hidden": 32, "layers": 2, "seq_len": 16}, "train": {"lr": 0.01}}
    mesh = SimpleNamespace(tp_comm=None, dp_group=None, tp_group=None, dp_rank=0, dp=1, tp=1)
    settings = JobSettings(steps=3, micro_batch=4, stage=1, precision="fp32", gradient_accumulation_steps=2)
    ctx = Context(mesh, model_config, settings, reporter=records.append)
    summary = my_model.train(ctx)
    engine = engines[0]
    forwards = [r for r in records if "loss" in r]
    assert summary["steps"] == 3 and engine.config.gradient_accumulation_steps == 2
    assert engine.global_step == 3 and engine.micro_steps == 6
    assert [r["tokens"] for r in forwards] == [4 * 2 * 16] * 3  # micro_batch x accumulation x seq_len rows
