"""Planning without Ray: mesh layout, memory source (declared vs NVML-measured), rank assignment, data
stream and progress display -- all pure."""

import dataclasses
import io
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hybrid.data import MarkovTokens
from hybrid.config.validate import quote
from hybrid.errors import ConfigError, PlanError
from hybrid.plan.memory import GB
from hybrid.plan.monitor import GpuInfo, NodeProbe
from hybrid.plan.planner import choose_stage
from launch.job.display import Progress, model_state_bytes
from launch.planning.model_size import model_facts
from launch.planning.plan import build_plan, mesh_layout, plan_dict
from launch.ray.probe import NodeReport
from launch.spec import load_spec, parse_spec
from launch.ray.workers import PlacementFailed, RankPlacement, assign_ranks

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
    # the same convention as hybrid.comm.mesh: rank = dp_rank * tp + tp_rank
    assert layout.tp_groups == [[k * tp + j for j in range(tp)] for k in range(layout.dp)]
    assert layout.dp_groups == [[k * tp + j for k in range(layout.dp)] for j in range(tp)]


def test_local_layout_is_two_tp_pairs_and_two_dp_pairs():
    layout = mesh_layout(2, 2, 2)
    assert layout.tp_groups == [[0, 1], [2, 3]] and layout.dp_groups == [[0, 2], [1, 3]]
    with pytest.raises(ConfigError, match="parallel.tp is 4"):
        mesh_layout(2, 6, 4)


@pytest.mark.parametrize("memory_gb, stage", [(0.0025, 3), (80.0, 1)])
def test_declared_plan_is_the_planners_choice(memory_gb, stage):
    lp = build_plan(spec_for(memory=memory_gb))
    memory_only = lp.memory_plan  # the guide's choice at the default TP degree and the job's micro-batch
    expected = choose_stage(lp.params, 2, 2, memory_gb * GB, precision="fp32",
                            activation_bytes=memory_only.activation_bytes,
                            checkpointed_activation_bytes=memory_only.checkpointed_activation_bytes)
    assert memory_only.stage == expected.stage == stage
    # the plan runs the fastest layout that fits, which the time model ranked among the guide's
    chosen = lp.time.chosen
    assert chosen.fits and (lp.layout.tp, lp.stage, lp.micro_batch) == (chosen.layout.tp, chosen.layout.stage,
                                                                          chosen.layout.micro_batch)
    assert lp.rows * lp.layout.dp == 16  # the global batch of the default layout: micro_batch 8 x DP 2
    assert lp.params == 134_912 and lp.memory_source == "declared" and "no Ray cluster contacted" in lp.memory_note
    assert lp.use_gpus is None


def test_forced_stage_and_tp_reach_the_plan():
    lp = build_plan(spec_for(gpus=4, tp=2, stage=2))
    assert (lp.stage, lp.layout.tp, lp.layout.dp) == (2, 2, 4) and "as requested" in lp.memory_plan.reason
    assert {c.layout.tp for c in lp.time.ranking.candidates} == {2}  # fixed choices are the only ones offered
    assert {c.layout.stage for c in lp.time.ranking.candidates} == {2}


def test_tp_that_cannot_split_the_model_is_a_config_error(tmp_path):
    model = tmp_path / "m.yaml"
    model.write_text("model: {vocab_size: 255, seq_len: 8, n_layers: 1, hidden: 8, n_heads: 2}\n")
    with pytest.raises(ConfigError, match=r"^parallel\.tp=2 cannot split this model: model\.vocab_size=255"):
        build_plan(spec_for(config=str(model), tp=2))
    assert build_plan(spec_for(config=str(model))).layout.tp == 1  # auto: the divisor that splits it


def test_tp_auto_takes_the_largest_divisor_of_gpus_per_node_that_splits_the_model(tmp_path):
    lp = build_plan(spec_for(nodes=1, gpus=3))  # gpt-tiny has 4 heads: tp 3 cannot split it
    assert (lp.layout.tp, lp.layout.dp) == (1, 3)
    assert lp.tp_reason.startswith("tp auto: 1, the largest divisor of gpus_per_node=3 that splits the model "
                                   "(tp 3: model.n_heads=4 is not divisible")
    from launch.planning.plan import choose_tp, tp_options

    eight = build_plan(spec_for(nodes=1, gpus=8))
    facts = model_facts(spec_for(nodes=1, gpus=8))
    assert choose_tp(None, 8, 8, facts)[0] == 4  # the default: the largest divisor that splits the model
    assert tp_options(None, 8, facts, 4) == [4, 2, 1]  # the degrees the time model weighs: never 8
    assert eight.layout.tp in (4, 2, 1) and {c.layout.tp for c in eight.time.ranking.candidates} == {4, 2, 1}
    with pytest.raises(ConfigError, match=r"^parallel\.tp=3 cannot split this model: model\.n_heads=4 .*or auto\.$"):
        build_plan(spec_for(nodes=1, gpus=3, tp=3))


def test_plan_measured_from_a_run_that_measured_nothing_is_a_user_error(tmp_path, capsys):
    from launch.cli import main

    cluster = tmp_path / "c.yaml"
    cluster.write_text(f"cluster: {{address: local, nodes: 2, gpus_per_node: 1, gpu_memory_gb: 80}}\n"
                       f"job: {{entrypoint: 'hybrid.models.gpt:train', config: {ROOT / 'configs/gpt-tiny.yaml'}, "
                       f"steps: 3, run_dir: {tmp_path / 'run'}}}\n")
    (tmp_path / "run").mkdir()
    for record, expected in (({"measured": {}, "predicted": {}}, "the run measured nothing"),
                             ([1, 2], "a JSON list, not an object"),
                             ({"measured": {"0": {"step": 1}}}, "lacks or garbles a field")):
        (tmp_path / "run" / "memory.json").write_text(json.dumps(record))
        assert main(["plan", str(cluster), "--measured", str(tmp_path / "run")]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: --measured ") and expected in err and err.count("\n") == 1, err


def test_an_unwritable_run_dir_is_refused_before_anything_starts(tmp_path):
    with pytest.raises(ConfigError, match=r"^job\.run_dir '/proc/hybrid-run' is not writable"):
        parse_spec({"cluster": {"address": "local", "nodes": 1, "gpus_per_node": 1, "gpu_memory_gb": 80},
                    "job": {"entrypoint": "hybrid.models.gpt:train", "config": "configs/gpt-tiny.yaml", "steps": 3,
                            "run_dir": "/proc/hybrid-run"}}, base_dir=ROOT)


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
    lp = build_plan(spec_for(memory=0.0025), [_report(0, 0, cpus=2), _report(1, 0, cpus=2)])
    assert lp.use_gpus is False and lp.memory_source == "declared" and lp.memory_plan.stage == 3
    assert "no GPUs" in lp.memory_note and "gpu_memory_gb = 0.0025 GB" in lp.memory_note
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


@pytest.mark.slow  # a CLI process importing torch: not in the fast tier (make test-fast)
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
    from hybrid.runtime.train import Context, JobSettings, run_steps

    got = []
    ctx = Context(None, {}, JobSettings(steps=5, micro_batch=2, stage=1), rank=3, world_size=4,
                  reporter=got.append, stop_requested=lambda: True)
    ctx.step = 2
    ctx.report({"loss": 1.5})
    assert got[0]["rank"] == 3 and got[0]["step"] == 2 and got[0]["loss"] == 1.5 and "time" in got[0]
    summary = run_steps(ctx, engine=None, batches=lambda step: pytest.fail("no step may run"), start_step=2)
    assert summary["steps"] == 2 and summary["last_loss"] is None and ctx.should_stop()


def test_an_own_loop_that_leaves_ctx_step_alone_reports_step_after_step_with_its_own_numbers():
    """As the README shows an own loop: ``ctx.report({"loss": ...})`` each step, ``ctx.step`` never set. Every
    report was tagged step 0, which the driver drops as already done: no progress line, no metrics.jsonl."""
    from hybrid.runtime.train import Context, JobSettings
    from launch.job.metrics import step_entry

    got = []
    ctx = Context(None, {}, JobSettings(steps=5, micro_batch=2, stage=1), reporter=got.append)
    for loss in (3.0, 2.5, 2.0):
        ctx.report({"loss": loss, "step_time_s": 0.1, "acc": 0.5, "note": "text"})
    ctx.report({"tokens_seen": 10})  # not a step's report: no step of its own
    assert [r["step"] for r in got] == [1, 2, 3, 3] and ctx.step == 3
    ctx.report({"loss": 1.5, "step": 7})  # a loop that names its steps keeps them
    assert got[-1]["step"] == 7 and ctx.step == 7
    entry = step_entry(2, {0: got[1]})
    assert entry["loss"] == 2.5 and entry["acc"] == 0.5 and "note" not in entry and "time" not in entry


# --- bring your own model: Ψ measured through build_model, tp only where the model has TP layers -----------
OWN = ROOT / "examples" / "own_model"


def own_spec(tmp_path, model_yaml=None, tp="auto", entrypoint="my_model:train", **parallel):
    config = OWN / "model.yaml"
    if model_yaml is not None:
        config = tmp_path / "model.yaml"
        config.write_text(model_yaml)
    return parse_spec({
        "cluster": {"address": "local", "nodes": 2, "gpus_per_node": 2, "gpu_memory_gb": 80},
        "job": {"entrypoint": entrypoint, "config": str(config), "steps": 3, "working_dir": str(OWN)},
        "parallel": {"tp": tp, "precision": "fp32", **parallel},
    }, base_dir=ROOT)


def test_own_model_is_counted_on_meta_and_gets_tp_1_without_tp_layers(tmp_path):
    lp = build_plan(own_spec(tmp_path))
    import my_model  # importable now: the plan put job.working_dir on sys.path, as Ray does on the ranks

    with torch.device("meta"):
        expected = sum(p.numel() for p in my_model.build_model({"model": {"vocab_size": 64, "hidden": 32,
                                                                          "layers": 2, "seq_len": 16}}).parameters())
    assert lp.params == expected == 20_992 and lp.tensor_parallel_layers is False
    assert (lp.layout.tp, lp.layout.dp) == (1, 4)
    assert lp.tp_reason == ("tp auto: 1, since the model has no tensor-parallel layers (no parameter is marked "
                            "tensor-parallel); DP spans all 4 ranks")
    assert "counted on the meta device by my_model.build_model" in lp.params_source
    doc = plan_dict(lp)
    assert doc["mesh"]["tp_reason"] == lp.tp_reason and doc["model"]["tensor_parallel_layers"] is False
    # the built-in GPT has TP layers: tp auto is gpus_per_node, and says why
    # (the time model weighs tp 1 too, and says when it runs another than this default)
    gpt = build_plan(spec_for())
    assert "tp auto: 2 = gpus_per_node, since the model has tensor-parallel layers" in gpt.tp_reason


def test_tp_forced_above_1_for_a_model_without_tp_layers_is_refused(tmp_path):
    with pytest.raises(ConfigError, match=r"parallel.tp is 2, but the model has no tensor-parallel layers .*; set "
                                          r"parallel.tp to 1 or auto\.$"):
        build_plan(own_spec(tmp_path, tp=2))
    assert build_plan(own_spec(tmp_path, tp=1)).layout.tp == 1


def test_params_is_an_override_checked_against_the_measured_count(tmp_path):
    shape = "model: {vocab_size: 64, hidden: 32, layers: 2, seq_len: 16}\n"
    lp = build_plan(own_spec(tmp_path, shape + "params: 21K\n"))  # 0.04% off the 20,992 counted
    assert lp.params == 21_000 and "within 1% of the 20,992 counted" in lp.params_source
    with pytest.raises(ConfigError) as err:
        build_plan(own_spec(tmp_path, shape + "params: 7B\n"))
    assert str(err.value) == (f"params in {quote(str(tmp_path / 'model.yaml'))} is 7,000,000,000, but my_model.build_model "
                              "builds a model of 20,992 parameters (off by more than 1%); remove params: (the count "
                              "is measured) or correct it.")
    # the built-in GPT's count is measured too
    gpt = tmp_path / "gpt.yaml"
    gpt.write_text((ROOT / "configs" / "gpt-tiny.yaml").read_text() + "\nparams: 7B\n")
    with pytest.raises(ConfigError, match="hybrid.models.gpt.training.build_model builds a model of 134,912"):
        build_plan(spec_for(config=str(gpt)))


def test_a_failing_or_wrong_build_model_hook_is_one_sentence(tmp_path):
    with pytest.raises(ConfigError, match=r"^my_model.build_model failed on the driver \(called under "
                                          r"torch.device\('meta'\) to count the parameters\): KeyError: 'hidden'"):
        build_plan(own_spec(tmp_path, "model: {vocab_size: 64, layers: 2, seq_len: 16}\n"))


def test_host_memory_is_probed_per_node_and_shared_by_nodes_on_one_machine(tmp_path):
    from launch.planning.plan import host_memory
    from launch.ray.probe import parse_meminfo

    assert parse_meminfo("MemTotal:  16000 kB\nMemFree: 100 kB\nMemAvailable:    8000 kB\n") == 8000 * 1024
    assert parse_meminfo("MemTotal:  16000 kB\n") == 16000 * 1024 and parse_meminfo("junk") is None
    spec = spec_for(cluster={"host_memory_gb": 64})
    assert host_memory(spec, None) == (64 * GB, "host memory declared: cluster.host_memory_gb = 64 GB per node")
    reports = [NodeReport(f"n{i}", "127.0.0.1", 2, 0, NodeProbe(False, "no NVML"), host_memory_bytes=10 * GB)
               for i in range(2)]
    got, note = host_memory(spec, reports)
    assert got == 5 * GB and note == ("host memory probed: 5 GB available per node (smallest node, shared by the 2 "
                                      "Ray nodes at 127.0.0.1)")
    lp = build_plan(spec_for(memory=0.0024, cluster={"host_memory_gb": 64}, activation_checkpointing=False), reports)
    assert lp.plan.offload and lp.plan.host_memory_bytes == 5 * GB
    assert "of 4.5 GB usable per node" in lp.memory_plan.reason


def test_hybrid_plan_prints_offload_when_only_offload_fits(tmp_path, capsys):
    from launch.cli import main

    cluster = tmp_path / "cluster.yaml"
    text = ("cluster: {address: local, nodes: 2, gpus_per_node: 2, gpu_memory_gb: MEMORY, host_memory_gb: 1}\n"
            f"job: {{entrypoint: 'hybrid.models.gpt:train', config: {ROOT / 'configs' / 'gpt-tiny.yaml'}, steps: 3}}\n"
            "parallel: {tp: 2, precision: fp32, activation_checkpointing: AC}\n")  # tp 2: only offload fits

    def write(memory, ac, extra=""):
        cluster.write_text(text.replace("MEMORY", str(memory)).replace("AC", ac + extra))

    write(0.0023, "false")
    assert main(["plan", str(cluster)]) == 0
    out = capsys.readouterr().out
    assert "  3 + offload         1.957 MB   1.079 MB  yes   <- chosen" in out
    assert "levers  activation checkpointing off (parallel.activation_checkpointing: false), optimizer offload on " \
           "(parallel.offload: auto)" in out
    assert "stage   ZeRO-3 with optimizer states offloaded to CPU: too large even for ZeRO-3" in out
    assert "host: 539.648 KB per rank x 2 = 1.079 MB of 900 MB usable per node" in out
    write(0.0017, "auto")  # now even that needs checkpointing too
    assert main(["plan", str(cluster), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert (doc["stage"], doc["offload"], doc["activation_checkpointing"]) == (3, True, True)
    assert doc["requested_activation_checkpointing"] == "auto" and doc["reason"].startswith(
        "too large even for ZeRO-3: ZeRO-3 with CPU offload of optimizer states and activation checkpointing")
    # offload with stage 0 forced: one sentence, exit 2
    write(80, "auto", ", offload: true, zero_stage: 0")
    assert main(["plan", str(cluster)]) == 2
    assert "parallel.offload is true but parallel.zero_stage is 0" in capsys.readouterr().err


def test_settings_carry_the_plans_levers():
    from launch.job.driver import settings_for

    lp = build_plan(spec_for(memory=0.0017))
    settings = settings_for(lp)
    assert (lp.memory_plan.stage, lp.memory_plan.offload, lp.memory_plan.activation_checkpointing) == (3, True, True)
    # the time model found a layout that fits without offload (tp 1, micro-batch 4): the ranks run that one
    assert (settings.stage, settings.offload, settings.activation_checkpointing) == \
        (lp.stage, lp.plan.offload, lp.plan.activation_checkpointing) == (3, False, True)
    assert (settings.micro_batch, settings.gradient_accumulation_steps) == (lp.micro_batch, lp.accumulation)


def test_the_built_in_entrypoint_turns_the_levers_into_its_engine_and_model_config():
    from hybrid.models.gpt.training import build_model, with_levers
    from hybrid.models.sections import TRAIN_DEFAULTS, training_config
    from hybrid.models.gpt.config import GPTConfig

    assert training_config(TRAIN_DEFAULTS, 3, "fp32").zero.offload_optimizer.device == "none"
    assert training_config(TRAIN_DEFAULTS, 3, "fp32", offload=True).zero.offload_optimizer.device == "cpu"
    config = GPTConfig.from_yaml(ROOT / "configs" / "gpt-tiny.yaml")
    assert with_levers(config, False) is config
    # the plan's activation checkpointing becomes the GPT's own field, on a copy of the config
    assert config.activation_checkpointing is False
    checkpointed = with_levers(config, True)
    assert checkpointed.activation_checkpointing is True and config.activation_checkpointing is False
    assert dataclasses.replace(checkpointed, activation_checkpointing=False) == config  # nothing else changed
    with torch.device("meta"):
        model = build_model({"model": config.to_dict()})
    assert sum(p.numel() for p in model.parameters()) == 134_912 and model.tok_emb.weight.is_meta
    with pytest.raises(ConfigError, match="no model: mapping .* define build_model"):
        build_model({"params": "7B"})


def test_kept_logs_move_the_previous_launchs_aside(tmp_path):
    from launch.ray.embedded_processes import keep_logs

    def session(name):
        logs = tmp_path / name / "ray" / "session_2026-12-02" / "logs"
        logs.mkdir(parents=True)
        (logs / "worker.out").write_text(name)
        return str(tmp_path / name)

    kept = tmp_path / "run" / "ray-logs"
    for name in ("first", "second", "third"):
        keep_logs(session(name), kept)
    assert (kept / "worker.out").read_text() == "third"
    assert (kept.parent / "ray-logs.previous" / "worker.out").read_text() == "second"


def test_plan_json_is_one_object_even_when_the_model_module_prints(tmp_path, capsys):
    import shutil

    from launch.cli import main

    own = tmp_path / "own_model"
    shutil.copytree(ROOT / "examples" / "own_model", own)
    source = own / "my_model.py"  # under a name no other test imported in this process
    (own / "printing_model.py").write_text('print("my_model imported")\n' + source.read_text())
    cluster = own / "cluster.yaml"
    cluster.write_text(cluster.read_text().replace("my_model:", "printing_model:"))
    assert main(["plan", str(own / "cluster.yaml"), "--json"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["model"]["params"] > 0
    assert "my_model imported" in captured.err


def test_launch_refuses_a_bad_model_config_before_any_ray_process_starts(tmp_path, monkeypatch, capsys):
    from launch.ray import cluster as ray_cluster
    from launch.cli import main

    def no_cluster(*a, **k):
        raise AssertionError("the model config is checked before a Ray cluster is started or contacted")

    monkeypatch.setattr(ray_cluster, "connect", no_cluster)
    model = tmp_path / "model.yaml"
    model.write_text((ROOT / "configs" / "gpt-tiny.yaml").read_text() + "train: {lr: -1}\n")
    cluster = tmp_path / "cluster.yaml"
    cluster.write_text(f"cluster: {{address: local, nodes: 1, gpus_per_node: 1, gpu_memory_gb: 80}}\n"
                       f"job: {{entrypoint: 'hybrid.models.gpt:train', config: {model}, steps: 2}}\n")
    assert main(["launch", str(cluster)]) == 2
    assert capsys.readouterr().err == "error: train.lr must be a number above 0, got -1.\n"
