"""A step whose global gradient norm is not finite, from the rank to metrics.jsonl: the engine (one process, a DP
group of one) skips its update, ``run_steps``' report of that step says ``nonfinite: True`` with
``skipped_steps`` counting it (and later steps ``nonfinite: False``, the count kept), and the driver's metrics
entry of the step -- what ``metrics.jsonl`` holds -- shows both."""

import io
import math

import torch
import torch.nn.functional as F
from torch import nn

import hybrid
from hybrid.runtime.train import Context, JobSettings, run_steps
from launch.job.display import Progress
from launch.job.metrics import MetricsWriter, read_metrics, step_entry

POISONED = 1  # the 0-based step whose batch holds a NaN


class Regression(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(4, 1)

    def forward(self, x, y):
        return F.mse_loss(self.fc(x), y)


def batches(step):
    x = torch.randn(2, 4, generator=torch.Generator().manual_seed(step))
    if step == POISONED:
        x[0, 0] = float("nan")
    return x, torch.ones(2, 1)


def test_a_skipped_step_is_in_the_report_and_in_the_metrics(tmp_path):
    engine = hybrid.initialize(Regression(), {"zero_optimization": {"stage": 1}, "precision": "fp32",
                                              "optimizer": {"type": "AdamW", "params": {"lr": 0.1}}})
    reports = []
    ctx = Context(None, {}, JobSettings(steps=4, micro_batch=2, stage=1), reporter=reports.append)
    run_steps(ctx, engine, batches)

    steps = [r for r in reports if "loss" in r]
    assert [(r["step"], r["nonfinite"], r["skipped_steps"]) for r in steps] == [
        (1, False, 0), (2, True, 1), (3, False, 1), (4, False, 1)]
    assert math.isnan(steps[1]["grad_norm"]) and all(math.isfinite(steps[i]["grad_norm"]) for i in (0, 2, 3))
    assert engine.optimizer_step_count == 3  # the poisoned step's update was skipped

    writer = MetricsWriter(tmp_path, tensorboard=False)
    progress = Progress(total_steps=4, world_size=1, stream=io.StringIO(), tty=False, on_step=writer.write)
    progress.add({"rank": 0, "reports": reports})
    lines = read_metrics(writer.path)
    assert [(e["step"], e["nonfinite"], e["skipped_steps"]) for e in lines] == [
        (1, False, 0), (2, True, 1), (3, False, 1), (4, False, 1)]
    assert lines[1]["grad_norm"] is None  # NaN is no JSON number


def test_the_steps_entry_says_skipped_when_its_ranks_do():
    def record(rank, nonfinite, skipped):
        return {"rank": rank, "step": 5, "loss": 1.0, "dp_rank": rank, "nonfinite": nonfinite,
                "skipped_steps": skipped}

    entry = step_entry(5, {0: record(0, True, 2), 1: record(1, True, 2)})
    assert (entry["nonfinite"], entry["skipped_steps"]) == (True, 2)
    entry = step_entry(6, {0: record(0, False, 2), 1: record(1, False, 2)})
    assert (entry["nonfinite"], entry["skipped_steps"]) == (False, 2)
    own_loop = step_entry(1, {0: {"rank": 0, "step": 1, "loss": 1.0}})  # an entrypoint's own report: no guard
    assert "nonfinite" not in own_loop and "skipped_steps" not in own_loop
