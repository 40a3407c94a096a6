"""Pure pieces of a job's records and shipping, without Ray: step entries and their throughput unit,
metrics.jsonl across restarts, TensorBoard events, the runtime_env, and the new cluster.yaml job fields."""

import io
import json
import os
import re
import sys
from pathlib import Path

import pytest
import torch

import hybrid
from hybrid.errors import ConfigError
from launch.job.display import Progress
from launch.job.metrics import METRICS_FILE, MetricsWriter, lines_before, read_metrics, step_entry, summary_lines
from launch.ray.runtime_env import localize, rank_env, runtime_env, working_dir_excludes
from hybrid.runtime.train import Context, JobSettings, run_steps
from launch.spec import parse_spec

ROOT = Path(__file__).resolve().parents[2]


def _records(step, unit="tokens", count=1024, world=2):
    return {r: {"rank": r, "step": step, "loss": 2.0 + r, "lr": 1e-3, "grad_norm": 0.5, "step_time_s": 0.5 + r,
                "throughput_unit": unit, unit: count, "tp_rank": 0, "dp_rank": r,
                "memory": {"params": 10, "grads": 20, "optimizer": 30}} for r in range(world)}


def test_a_step_entry_carries_the_entrypoints_unit():
    entry = step_entry(3, _records(3, unit="samples", count=64))
    assert entry == {"step": 3, "loss": 2.5, "lr": 1e-3, "grad_norm": 0.5, "step_time_s": 1.5,
                     "throughput": 64 / 1.5, "throughput_unit": "samples/s", "model_state_bytes": [60.0, 60.0],
                     "ranks_reported": 2}
    assert step_entry(1, _records(1))["throughput_unit"] == "tokens/s"


def test_a_regression_model_is_never_shown_in_tokens():
    out = io.StringIO()
    progress = Progress(total_steps=1, world_size=2, stream=out, tty=False)
    for rank, record in _records(1, unit="samples", count=64).items():
        progress.add({"rank": rank, "reports": [record]})
    text = out.getvalue() + progress.summary([], 1.0)
    assert "samples/s" in text and "tokens" not in text


def test_an_entrypoints_own_report_reaches_metrics_as_plain_finite_json(tmp_path):
    from hybrid.runtime.train import TrainError

    got = []
    ctx = Context(None, {}, JobSettings(steps=2, micro_batch=2, stage=1), rank=0, world_size=1, reporter=got.append)
    ctx.step = 1
    ctx.report({"loss": torch.tensor(2.5), "lr": torch.tensor([1e-3]), "extra": {"a": torch.ones(2)}})
    assert (got[0]["loss"], got[0]["lr"], got[0]["extra"]) == (2.5, pytest.approx(1e-3), {"a": [1.0, 1.0]})
    for bad, shown in (("low", "str 'low'"), (None, "NoneType 'None'"), (torch.ones(2), "list '[1.0, 1.0]'")):
        with pytest.raises(TrainError, match=rf"^ctx.report\(\): 'loss' must be a number \(a float or a "
                                             rf"one-element tensor\), got {re.escape(shown)}; report"):
            ctx.report({"loss": bad})
    entry = step_entry(1, {0: {"rank": 0, "step": 1, "loss": float("nan")}})  # no step_time_s: it is optional
    assert entry["step_time_s"] is None and entry["throughput"] is None  # nothing counted: no rate, not 0
    writer = MetricsWriter(tmp_path, tensorboard=False)
    writer.write(entry)
    writer.write({**_entry(2, loss=float("inf")), "grad_norm": float("nan")})
    rows = [json.loads(line, parse_constant=pytest.fail) for line in (tmp_path / METRICS_FILE).read_text().splitlines()]
    assert [(r["loss"], r.get("grad_norm")) for r in rows] == [(None, None), (None, None)]  # JSON has no NaN


def _entry(step, loss=1.0):
    return {"step": step, "loss": loss, "throughput": 1.0, "throughput_unit": "samples/s", "model_state_bytes": []}


def test_metrics_survive_restarts_without_duplicates_or_gaps(tmp_path):
    first = MetricsWriter(tmp_path, tensorboard=False)
    for step in range(1, 8):  # attempt 1 reaches step 7, its last checkpoint was step 5
        first.write(_entry(step, loss=1.0))
    first.write(_entry(6, loss=2.0))  # attempt 2 of the same launch resumes from step 5
    first.write(_entry(7, loss=2.0))
    with open(tmp_path / METRICS_FILE, "a") as f:
        f.write('{"step": 8, "lo')  # the driver died mid-line
    later = MetricsWriter(tmp_path, tensorboard=False)  # a later launch resumes from checkpoint step 6
    for step in range(7, 10):
        later.write(_entry(step, loss=3.0))
    rows = [json.loads(line) for line in (tmp_path / METRICS_FILE).read_text().splitlines()]  # plain JSON
    assert [r["step"] for r in rows] == list(range(1, 10))
    assert [r["loss"] for r in rows] == [1.0] * 5 + [2.0] + [3.0] * 3
    assert read_metrics(tmp_path / METRICS_FILE) == rows


def test_a_fresh_run_replaces_an_old_runs_metrics(tmp_path):
    old = MetricsWriter(tmp_path, tensorboard=False)
    for step in (1, 2, 3):
        old.write(_entry(step))
    MetricsWriter(tmp_path, tensorboard=False).write(_entry(1, loss=9.0))
    assert read_metrics(tmp_path / METRICS_FILE) == [_entry(1, loss=9.0)]
    assert lines_before(['{"step": 1}\n', '{"step": 2}'], 2) == ['{"step": 1}\n']


def test_tensorboard_events_are_written_when_installed(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    writer = MetricsWriter(tmp_path)
    for step in (1, 2, 3):
        writer.write({**_entry(step, loss=float(step)), "lr": 0.1, "grad_norm": 1.0, "step_time_s": 0.2})
    writer.close()
    events = EventAccumulator(str(writer.tensorboard_dir))
    events.Reload()
    assert [e.value for e in events.Scalars("train/loss")] == [1.0, 2.0, 3.0]
    assert "train/throughput_samples_per_s" in events.Tags()["scalars"]


def test_summary_lines_compare_with_the_reference_and_say_where_everything_is(tmp_path):
    writer = MetricsWriter(tmp_path, tensorboard=False)
    history = [_entry(s, loss=l) for s, l in enumerate([4.0, 3.0, 2.0, 1.0], 1)]
    lines = summary_lines({0: {"reference_loss": {"name": "unigram entropy of the data", "nats": 3.0}}}, history,
                          writer, "/tmp/ray/session_x/logs")
    assert lines[0] == ("final loss 2.5000 nats (mean of the last 4 steps), below the unigram entropy of the data "
                        "(3.0000 nats)")
    assert lines[1] == f"metrics {tmp_path / METRICS_FILE}"
    assert lines[2] == "full rank logs (stdout/stderr of every worker): /tmp/ray/session_x/logs"
    silent = summary_lines({0: None}, [], writer, "/logs")  # an entrypoint that never reported a step
    assert silent[0].startswith("warning: the entrypoint reported no step in this run, so there are no metrics")
    assert not any(str(tmp_path / METRICS_FILE) in line for line in silent)  # no path to a file never written


def _spec(tmp_path, **job):
    (tmp_path / "model.yaml").write_text("model: {vocab_size: 256, seq_len: 8, n_layers: 1, hidden: 16, n_heads: 2}\n")
    return parse_spec({"cluster": {"address": "local", "nodes": 1, "gpus_per_node": 1, "gpu_memory_gb": 1},
                       "job": {"entrypoint": "hybrid.models.gpt:train", "config": "model.yaml", "steps": 1, **job}},
                      base_dir=tmp_path, path=tmp_path / "mine.yaml")


def test_job_fields_run_dir_working_dir_and_env(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    spec = _spec(tmp_path)
    assert spec.job.working_dir == tmp_path and spec.job.run_dir == tmp_path / "runs" / "mine" and spec.job.env == {}
    (tmp_path / "code").mkdir()
    spec = _spec(tmp_path, working_dir="code", run_dir="out", env={"A": 1, "B": True, "C": "x"},
                 checkpoint={"dir": "ckpt"})
    assert spec.job.working_dir == tmp_path / "code" and spec.job.run_dir == tmp_path / "out"
    assert spec.job.env == {"A": "1", "B": "true", "C": "x"}
    assert _spec(tmp_path, checkpoint={"dir": "ckpt"}).job.run_dir == tmp_path / "ckpt"
    for job, message in [({"working_dir": "nowhere"}, "job.working_dir is 'nowhere', but"),
                         ({"env": ["A"]}, "job.env must be a mapping like {MY_FLAG: '1'}, got list ['A']."),
                         ({"env": {"A": {"b": 1}}},
                          "job.env.A must be a string (without a NUL character) or a number, got {'b': 1}."),
                         ({"run_dir": 3}, "job.run_dir must be a directory path for metrics and logs, got 3.")]:
        with pytest.raises(ConfigError, match="^" + re.escape(message)):
            _spec(tmp_path, **job)


def test_the_entrypoint_is_found_in_the_working_dir_from_any_current_directory(tmp_path, monkeypatch):
    code = tmp_path / "code"
    code.mkdir()
    (code / "records_user_module.py").write_text("def train(ctx):\n    return 1\n")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    monkeypatch.setattr("sys.path", [p for p in sys.path if p not in ("", os.getcwd())])
    spec = _spec(tmp_path, entrypoint="records_user_module:train", working_dir="code")
    assert spec.job.entrypoint == "records_user_module:train"
    with pytest.raises(ConfigError, match="cannot be imported"):
        _spec(tmp_path, entrypoint="not_a_module_anywhere:train", working_dir="code")


def test_the_runtime_env_ships_the_working_dir_without_runs_and_sets_job_env(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", "/opt/x")
    spec = _spec(tmp_path, env={"MY_FLAG": "1", "OMP_NUM_THREADS": "2"}, checkpoint={"dir": "runs/a"},
                 run_dir="runs/a")
    env = runtime_env(spec)
    assert env["working_dir"] == str(tmp_path)
    assert "/runs/a/" in env["excludes"] and ".venv/" in env["excludes"] and ".git" in env["excludes"]
    assert env["env_vars"]["MY_FLAG"] == "1" and env["env_vars"]["OMP_NUM_THREADS"] == "2"  # job.env wins
    assert env["env_vars"]["PYTHONPATH"] == f"/opt/x:{os.getcwd()}" and env["env_vars"]["GLOO_SOCKET_IFNAME"] == "lo"
    outside = _spec(tmp_path, checkpoint={"dir": str(tmp_path.parent / "elsewhere")})
    assert not any("elsewhere" in e for e in working_dir_excludes(outside))
    assert rank_env(outside)["MASTER_ADDR"] == "127.0.0.1"


def test_localize_maps_paths_inside_the_working_dir_to_the_ranks_copy(tmp_path):
    assert localize(str(tmp_path / "cfg" / "m.yaml"), str(tmp_path), "/copy") == "/copy/cfg/m.yaml"
    assert localize("/data/corpus.bin", str(tmp_path), "/copy") == "/data/corpus.bin"


class Regression(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 1)

    def forward(self, x, y):
        return ((self.linear(x) - y) ** 2).mean()


def test_run_steps_reports_lr_grad_norm_and_samples_for_a_model_without_tokens():
    torch.manual_seed(0)
    engine = hybrid.initialize(Regression(), {"zero_optimization": {"stage": 1},
                                              "optimizer": {"type": "AdamW", "params": {"lr": 0.01}}})
    records = []
    ctx = Context(None, {}, JobSettings(steps=3, micro_batch=5, stage=1, precision="fp32"), reporter=records.append)
    x = torch.randn(5, 4)
    run_steps(ctx, engine, lambda step: (x, x.sum(1, keepdim=True)))
    assert [r["step"] for r in records] == [1, 2, 3]
    assert all(r["throughput_unit"] == "samples" and r["samples"] == 5 and "tokens" not in r for r in records)
    assert all(r["lr"] == 0.01 and r["grad_norm"] > 0 for r in records)
    assert step_entry(1, {0: records[0]})["throughput_unit"] == "samples/s"


def test_a_return_value_that_cannot_reach_the_driver_is_dropped_with_a_warning(capsys):
    """Training was done by then: failing the job over it (and retrying it under max_failures) helped nobody."""
    import threading

    from launch.ray.workers import _sendable

    assert _sendable({"loss": 1.5}, "mine:train", 0) == {"loss": 1.5}
    assert _sendable({"lock": threading.Lock()}, "mine:train", 1) is None
    assert capsys.readouterr().out.startswith("warning: rank 1: the return value of mine:train cannot be sent to "
                                              "the driver (TypeError: cannot pickle")
