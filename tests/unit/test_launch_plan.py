"""Planning without Ray: mesh layout, memory source (declared vs NVML-measured), rank assignment, data
stream and progress display -- all pure."""

import io
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hybrid.data import MarkovTokens
from hybrid.errors import ConfigError, PlanError
from hybrid.memory import GB
from hybrid.monitor import GpuInfo, NodeProbe
from hybrid.planner import choose_stage
from launch.display import Progress, model_state_bytes
from launch.plan import build_plan, mesh_layout, plan_dict
from launch.probe import NodeReport
from launch.spec import load_spec, parse_spec
from launch.workers import PlacementFailed, RankPlacement, assign_ranks

ROOT = Path(__file__).resolve().parents[2]


def spec_for(nodes=2, gpus=2, memory=80.0, tp="auto", stage="auto", config="configs/gpt-tiny.yaml",
             precision="fp32", entrypoint="hybrid.models.gpt:train", cluster=(), **parallel):
    return parse_spec({
        "cluster": {"address": "local", "nodes": nodes, "gpus_per_node": gpus, "gpu_memory_gb": memory,
                    **dict(cluster)},
        "job": {"entrypoint": entrypoint, "config": config, "steps": 3},
        "parallel": {"tp": tp, "zero_stage": stage, "precision": precision, **parallel},
    }, base_dir=ROOT)


@pytest.mark.parametrize("nodes, gpus, tp", [(2, 2, 2), (2, 4, 2), (3, 4, 4), (4, 8, 1), (1, 8, 8)])
def test_mesh_layout_keeps_tp_groups_inside_a_node(nodes, gpus, tp):
    layout = mesh_layout(nodes, gpus, tp)
    assert layout.dp == nodes * gpus // tp
    node_of = {r: n for n, ranks in enumerate(layout.node_ranks) for r in ranks}
    assert sorted(node_of) == list(range(nodes * gpus))
    for group in layout.tp_groups:
        assert len(group) == tp and len({node_of[r] for r in group}) == 1
    for group in layout.dp_groups:
        assert len(group) == layout.dp
    assert sorted(r for g in layout.dp_groups for r in g) == list(range(nodes * gpus))
    # the same convention as hybrid.mesh: rank = dp_rank * tp + tp_rank
    assert layout.tp_groups == [[k * tp + j for j in range(tp)] for k in range(layout.dp)]
    assert layout.dp_groups == [[k * tp + j for k in range(layout.dp)] for j in range(tp)]


def test_local_layout_is_two_tp_pairs_and_two_dp_pairs():
    layout = mesh_layout(2, 2, 2)
    assert layout.tp_groups == [[0, 1], [2, 3]] and layout.dp_groups == [[0, 2], [1, 3]]
    with pytest.raises(ConfigError, match="parallel.tp is 4"):
        mesh_layout(2, 6, 4)


@pytest.mark.parametrize("memory_gb, stage", [(0.0016, 3), (80.0, 1)])
def test_declared_plan_is_the_planners_choice(memory_gb, stage):
    lp = build_plan(spec_for(memory=memory_gb))
    expected = choose_stage(lp.params, 2, 2, memory_gb * GB, precision="fp32",
                            activation_bytes=lp.plan.activation_bytes)
    assert lp.stage == expected.stage == stage
    assert lp.params == 134_912 and lp.memory_source == "declared" and "no Ray cluster contacted" in lp.memory_note
    assert lp.use_gpus is None


def test_forced_stage_and_tp_reach_the_plan():
    lp = build_plan(spec_for(gpus=4, tp=2, stage=2))
    assert (lp.stage, lp.layout.tp, lp.layout.dp) == (2, 2, 4) and "as requested" in lp.plan.reason


def test_tp_that_cannot_split_the_model_is_a_config_error(tmp_path):
    model = tmp_path / "m.yaml"
    model.write_text("model: {vocab_size: 255, seq_len: 8, n_layers: 1, hidden: 8, n_heads: 2}\n")
    with pytest.raises(ConfigError, match="vocab_size"):
        build_plan(spec_for(config=str(model)))


def test_plain_params_count_is_accepted_for_foreign_models(tmp_path):
    model = tmp_path / "m.yaml"
    model.write_text("params: 7B\n")
    lp = build_plan(spec_for(nodes=1, gpus=8, config=str(model), precision="bf16",
                             entrypoint="tests.launch.entrypoints:where"))  # a module without build_model
    assert lp.params == 7_000_000_000 and lp.plan.activation_bytes == 0.0
    # not built, so its TP layers are unknown: tp auto is 1, and the plan says why
    assert lp.layout.tp == 1 and lp.layout.dp == 8 and "unknown" in lp.tp_reason


def _report(i, gpus, cpus=8, nvml=True, total_gb=80):
    infos = [GpuInfo(g, "NVIDIA H100 80GB HBM3", int(total_gb * GB), 0, int(total_gb * GB), 0.0) for g in range(int(gpus))]
    probe = NodeProbe(True, "NVML: ok", infos) if nvml and gpus else NodeProbe(False, "NVML Shared Library Not Found")
    return NodeReport(node_id=f"n{i}", ip=f"10.0.0.{i}", cpus=cpus, gpus=gpus, probe=probe)


def test_probed_memory_is_used_when_every_node_measured():
    reports = [_report(0, 8, total_gb=80), _report(1, 8, total_gb=40)]
    lp = build_plan(spec_for(gpus=8, tp=4, memory=10.0), reports)
    assert lp.use_gpus is True and lp.memory_source == "measured"
    assert lp.plan.gpu_memory_bytes == 40 * GB and "NVML" in lp.memory_note and "40 GB" in lp.memory_note


def test_declared_memory_is_used_and_said_without_nvml():
    lp = build_plan(spec_for(memory=0.0016), [_report(0, 0, cpus=2), _report(1, 0, cpus=2)])
    assert lp.use_gpus is False and lp.memory_source == "declared" and lp.stage == 3
    assert "no GPUs" in lp.memory_note and "gpu_memory_gb = 0.0016 GB" in lp.memory_note
    lp = build_plan(spec_for(gpus=8, tp=4), [_report(0, 8, nvml=False), _report(1, 8, nvml=False)])
    assert lp.use_gpus is True and lp.memory_source == "declared" and "NVML unavailable on 2 of 2" in lp.memory_note


def test_too_small_a_ray_cluster_is_a_plan_error():
    with pytest.raises(PlanError, match="cluster.nodes is 2"):
        build_plan(spec_for(), [_report(0, 0, cpus=2)])


def test_plan_json_needs_no_ray(monkeypatch, capsys):
    import ray

    from launch.cli import main

    def no_ray(*a, **k):
        raise AssertionError("hybrid plan must not start or contact Ray")

    monkeypatch.setattr(ray, "init", no_ray)
    assert main(["plan", str(ROOT / "clusters" / "dgx-h100-8x8.yaml"), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["mesh"]["tp"] == 8 and doc["mesh"]["dp"] == 8 and len(doc["mesh"]["nodes"]) == 8
    assert doc["memory"]["source"] == "declared" and "no Ray cluster contacted" in doc["memory"]["note"]
    assert doc["stage"] in (0, 1, 2, 3) and doc["reason"] and set(doc["memory"]["stages"]) == {"0", "1", "2", "3"}
    assert not ray.is_initialized()


def test_plan_json_cli_subprocess(capsys):
    proc = subprocess.run([sys.executable, "-m", "launch.cli", "plan", "clusters/dgx-h100-8x8.yaml", "--json"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["model"]["params"] == 13_111_183_360

    from launch.cli import main

    assert main(["plan", str(ROOT / "clusters" / "local.yaml")]) == 0
    text = capsys.readouterr().out
    assert "TP groups: [0,1] [2,3]" in text and "DP groups: [0,2] [1,3]" in text and "<- chosen" in text


def test_assign_ranks_groups_by_node_whatever_the_bundle_order():
    node_ids = ["b", "a", "b", "c", "a", "c"]
    ranks = assign_ranks(node_ids, 2, ips=["10.0.0.2", "10.0.0.1", "10.0.0.2", "10.0.0.3", "10.0.0.1", "10.0.0.3"])
    assert ranks == [2, 0, 3, 4, 1, 5]
    by_rank = [node_ids[ranks.index(r)] for r in range(6)]
    assert by_rank == ["a", "a", "b", "b", "c", "c"]
    with pytest.raises(PlacementFailed, match="3 rank actors"):
        assign_ranks(["a", "a", "a", "b"], 2)


def test_markov_stream_is_deterministic_learnable_and_sliced_by_dp_rank():
    stream = MarkovTokens(64, 16, seed=3)
    x, y = stream.batch(5, micro_batch=4, dp_rank=0, dp=2)
    x2, _ = stream.batch(5, micro_batch=4, dp_rank=0, dp=2)
    other, _ = stream.batch(5, micro_batch=4, dp_rank=1, dp=2)
    assert torch.equal(x, x2) and not torch.equal(x, other) and x.shape == (4, 16)
    assert torch.equal(x[:, 1:], y[:, :-1])
    whole, _ = stream.batch(5, micro_batch=8, dp_rank=0, dp=1)
    assert torch.equal(torch.cat([x, other]), whole)  # DP slices partition the global batch
    assert not torch.equal(stream.batch(6, 4)[0], stream.batch(5, 4)[0])
    # every transition is one of the chain's successors
    assert all(int(b) in stream.successors[int(a)].tolist() for a, b in zip(x.flatten(), y.flatten()))


def _records(step, losses):
    return [{"rank": r, "step": step, "loss": loss, "step_time_s": 0.5, "tokens": 1000, "tp_rank": r % 2,
             "dp_rank": r // 2, "tokens_per_s": 2000.0, "memory": {"params": 10, "grads": 20, "optimizer": 30}}
            for r, loss in enumerate(losses)]


def test_progress_plain_lines_and_tty_line():
    out = io.StringIO()
    progress = Progress(total_steps=2, world_size=4, stream=out, tty=False)
    for record in _records(1, [4.0, 4.0, 2.0, 2.0]):
        progress.add({"rank": record["rank"], "reports": [record]})
    for record in _records(2, [1.0, 1.0, 1.0, 1.0])[:3]:
        progress.add({"rank": record["rank"], "reports": [record]})
    assert out.getvalue() == "step 1/2  loss 3.0000  2,000 tokens/s  model states/rank 60 B\n"
    progress.add({"rank": 3, "reports": _records(2, [1.0] * 4)[3:]})
    assert out.getvalue().count("\n") == 2 and [h["step"] for h in progress.history] == [1, 2]
    table = progress.summary([RankPlacement(r, f"n{r // 2}", "127.0.0.1", r // 2) for r in range(4)], 3.0)
    assert "loss 3.0000 (step 1) -> 1.0000 (step 2)" in table and len(table.splitlines()) == 6

    tty = io.StringIO()
    progress = Progress(total_steps=1, world_size=1, stream=tty, tty=True)
    progress.add({"rank": 0, "reports": _records(1, [2.0])})
    progress.close()
    assert tty.getvalue().startswith("\r\033[K[" + "#" * 20 + "] step 1/1") and tty.getvalue().endswith("\n")
    assert model_state_bytes({"params": 1, "grads": 2, "optimizer": 3, "buffers": 100}) == 6.0


def test_shipped_local_demo_plans_offline():
    lp = build_plan(load_spec(ROOT / "clusters" / "local.yaml"))
    assert (lp.layout.tp, lp.layout.dp) == (2, 2) and plan_dict(lp)["backend"].startswith("nccl with GPUs")


def test_context_tags_reports_and_the_loop_honours_should_stop():
    from hybrid.train import Context, JobSettings, run_steps

    got = []
    ctx = Context(None, {}, JobSettings(steps=5, micro_batch=2, stage=1), rank=3, world_size=4,
                  reporter=got.append, stop_requested=lambda: True)
    ctx.step = 2
    ctx.report({"loss": 1.5})
    assert got[0]["rank"] == 3 and got[0]["step"] == 2 and got[0]["loss"] == 1.5 and "time" in got[0]
    summary = run_steps(ctx, engine=None, batches=lambda step: pytest.fail("no step may run"), start_step=2)
    assert summary["steps"] == 2 and summary["last_loss"] is None and ctx.should_stop()
