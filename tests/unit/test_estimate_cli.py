"""`hybrid estimate` and `hybrid monitor`: the seed's table, the issue's JSON, one-line errors (exit 2)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from hybrid.planner import ROW_STAGE1
from launch.cli import main

HYBRID = str(Path(sys.executable).with_name("hybrid"))


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_json_for_13b_on_8_gpus_is_the_issue_example(capsys):
    code, out, err = run(capsys, "estimate", "--params", "13B", "--gpus", "8", "--json")
    assert code == 0 and err == ""
    result = json.loads(out)
    reason = result.pop("reason")
    assert result == {
        "params": 13000000000,
        "dp": 8,
        "tp": 1,
        "gpu_memory_gb": 80,
        "stages": {
            "0": {"params_gb": 26.0, "grads_gb": 26.0, "optimizer_gb": 156.0, "total_gb": 208.0, "fits": False},
            "1": {"params_gb": 26.0, "grads_gb": 26.0, "optimizer_gb": 19.5, "total_gb": 71.5, "fits": True},
            "2": {"params_gb": 26.0, "grads_gb": 3.25, "optimizer_gb": 19.5, "total_gb": 48.75, "fits": True},
            "3": {"params_gb": 3.25, "grads_gb": 3.25, "optimizer_gb": 19.5, "total_gb": 26.0, "fits": True},
        },
        "recommended_stage": 1,
        "offload": False,
        "activation_checkpointing": False,
    }
    assert reason.startswith(ROW_STAGE1)
    assert out.count("\n") == 1  # exactly one JSON object on one line


def test_json_with_tp_and_activations(capsys):
    code, out, _ = run(
        capsys, "estimate", "--params", "13e9", "--gpus", "16", "--tp", "2", "--json",
        "--layers", "40", "--hidden", "5120", "--heads", "40", "--seq", "2048", "--micro-batch", "1",
    )
    result = json.loads(out)
    assert code == 0 and (result["dp"], result["tp"]) == (8, 2)
    # 2048·1·5120·(10 + 24/2 + 5·40·2048/(5120·2)) bytes per layer, 40 layers.
    activations = 2048 * 5120 * 62 * 40 / 1e9
    assert result["activations_gb"] == activations and result["activations_estimate"] == "korthikanti"
    assert result["stages"]["3"]["params_gb"] == 1.625
    assert result["stages"]["3"]["total_gb"] == pytest.approx(13 + activations)


def test_human_output_is_the_seed_table(capsys):
    code, out, _ = run(capsys, "estimate", "--params", "7B", "--gpus", "8")
    assert code == 0
    lines = out.splitlines()

    def row(label):
        return next(line for line in lines if line.startswith(label)).split()

    assert row("Component")[1:] == ["Stage", "0", "(DDP)", "Stage", "1", "Stage", "2", "Stage", "3"]
    assert row("Params (BF16)")[2:] == ["14", "GB", "14", "GB", "14", "GB", "1.75", "GB"]
    assert row("Grads (BF16)")[2:] == ["14", "GB", "14", "GB", "1.75", "GB", "1.75", "GB"]
    assert row("Optimizer (FP32)")[2:] == ["84", "GB", "10.5", "GB", "10.5", "GB", "10.5", "GB"]
    assert row("Per GPU")[2:] == ["112", "GB", "38.5", "GB", "26.25", "GB", "14", "GB"]
    assert row("Fits on 80 GB?")[4:] == ["No", "Yes", "Yes", "Yes"]
    assert "Recommended: ZeRO stage 1" in out and ROW_STAGE1 in out


def test_human_output_for_offload(capsys):
    code, out, _ = run(
        capsys, "estimate", "--params", "13B", "--gpus", "8", "--gpu-memory", "20", "--headroom", "0"
    )
    assert code == 0 and "Recommended: ZeRO stage 3 with CPU offload of optimizer states" in out


@pytest.mark.parametrize(
    "argv, field",
    [
        (["--params", "7B", "--gpus", "0"], "--gpus"),
        (["--params", "-7B", "--gpus", "8"], "--params"),
        (["--params", "lots", "--gpus", "8"], "--params"),
        (["--params", "7B", "--gpus", "8", "--precision", "fp8"], "--precision"),
        (["--params", "7B", "--gpus", "eight"], "--gpus"),
        (["--params", "7B"], "--gpus"),
        (["--params", "7B", "--gpus", "8", "--tp", "3"], "--tp"),
        (["--params", "7B", "--gpus", "8", "--gpu-memory", "-80"], "--gpu-memory"),
        (["--params", "7B", "--gpus", "8", "--headroom", "1.5"], "--headroom"),
        (["--params", "7B", "--gpus", "8", "--layers", "32"], "--hidden"),
        (["--params", "700B", "--gpus", "1"], "at least 39 GPUs"),
        (["--params", "7B", "--gpus", "8", "--vocab", "50304"], "--layers"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(capsys, argv, field):
    code, out, err = run(capsys, "estimate", *argv)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("error: ") and field in err


SHAPE_7B = {"--layers": "32", "--hidden": "4096", "--heads": "32", "--seq": "2048", "--micro-batch": "1"}


@pytest.mark.parametrize("vocab", [None, "50304"])
@pytest.mark.parametrize(
    "change, tp, named",
    [
        ({"--heads": "30"}, "1", ("--heads (30)", "--hidden (4096)")),  # 4096 is no multiple of 30
        ({"--heads": "20", "--hidden": "4100"}, "8", ("--tp (8)", "--heads (20)")),
    ],
)
def test_a_shape_the_gpt_cannot_have_is_refused_naming_the_options(capsys, vocab, change, tp, named):
    shape = {**SHAPE_7B, **change}
    argv = ["--params", "7B", "--gpus", "8", "--tp", tp, *[x for kv in shape.items() for x in kv]]
    code, out, err = run(capsys, "estimate", *argv, *(["--vocab", vocab] if vocab else []))
    assert code == 2 and out == "" and err.count("\n") == 1 and err.startswith("error: ")
    assert all(text in err for text in named) and "model." not in err, err


def test_a_vocabulary_tp_cannot_split_is_refused_naming_the_options(capsys):
    argv = ["--params", "7B", "--gpus", "8", "--tp", "8", *[x for kv in SHAPE_7B.items() for x in kv]]
    code, out, err = run(capsys, "estimate", *argv, "--vocab", "50305")
    assert code == 2 and out == "" and err.startswith("error: --tp (8) does not divide --vocab (50305)"), err
    assert run(capsys, "estimate", *argv, "--vocab", "50304")[0] == 0


def _plan_of_13b_on_dgx(memory_gb):
    """``hybrid plan`` of clusters/dgx-h100-8x8.yaml (the built-in 13B GPT, 8 nodes × 8 GPUs, TP 8) with
    cluster.gpu_memory_gb set to ``memory_gb``."""
    from hybrid.yamlfile import load_yaml
    from launch.plan import build_plan
    from launch.spec import parse_spec

    path = Path(__file__).resolve().parents[2] / "clusters" / "dgx-h100-8x8.yaml"
    doc = load_yaml(path, "cluster file")
    doc["cluster"]["gpu_memory_gb"] = memory_gb
    return build_plan(parse_spec(doc, base_dir=path.parent, path=path))


@pytest.mark.parametrize("checkpointing", [False, True])
def test_estimate_with_vocab_agrees_with_the_plan_of_the_same_model(capsys, checkpointing):
    lp = _plan_of_13b_on_dgx(18)
    m, layout, plan = lp.model, lp.layout, lp.plan
    argv = ["--params", str(lp.params), "--gpus", str(layout.dp * layout.tp), "--tp", str(layout.tp),
            "--layers", str(m["n_layers"]), "--hidden", str(m["hidden"]), "--heads", str(m["n_heads"]),
            "--seq", str(m["seq_len"]), "--micro-batch", str(lp.spec.job.micro_batch), "--vocab", str(m["vocab_size"]),
            "--gpu-memory", "18", "--precision", lp.spec.parallel.precision, "--json"]
    code, out, err = run(capsys, "estimate", *argv, *(["--activation-checkpointing"] if checkpointing else []))
    assert code == 0 and err == "", err
    result = json.loads(out)
    assert result["activations_estimate"] == "gpt"
    if checkpointing:  # the figure the plan keeps for checkpointing, and the plan's lever then
        assert result["activations_gb"] == plan.checkpointed_activation_bytes / 1e9
        assert result["activation_checkpointing"] is True
        return
    assert (result["recommended_stage"], plan.stage) == (1, 1)  # the probe's case: estimate said stage 2
    assert result["activations_gb"] == plan.activation_bytes / 1e9
    for stage, row in result["stages"].items():
        assert row["total_gb"] == pytest.approx((plan.stages[int(stage)].total + plan.activation_bytes) / 1e9)
        assert row["fits"] == plan.fits[int(stage)]
    assert result["reason"] == plan.reason
    code, out, _ = run(capsys, "estimate", *argv[:-1])
    assert code == 0 and "Activations (GPT)" in out and "Recommended: ZeRO stage 1\n" in out


def test_console_script_help_and_exit_codes():
    done = subprocess.run([HYBRID, "estimate", "--help"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "--micro-batch" in done.stdout and "--params" in done.stdout
    done = subprocess.run(
        [HYBRID, "estimate", "--gpus", "0", "--params", "7B"], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.splitlines() == ["error: --gpus must be a whole number from 1 to 10000000 (the total GPU count, DP × TP), got 0."]


def test_monitor_command_reports_this_node(capsys):
    code, out, _ = run(capsys, "monitor")
    assert code == 0 and out.strip()
    assert out.startswith("no NVML: ") or out.startswith("NVML: ")
    code, out, _ = run(capsys, "monitor", "--json")
    assert code == 0 and isinstance(json.loads(out)["available"], bool)


def test_the_estimate_reaches_for_activation_checkpointing_before_offload(capsys):
    shape = ["--layers", "40", "--hidden", "5120", "--heads", "40", "--seq", "4096", "--micro-batch", "4"]
    code, out, _ = run(capsys, "estimate", "--params", "13B", "--gpus", "8", "--tp", "8", "--json", *shape)
    result = json.loads(out)  # ZeRO-3 does not fit with ~111 GB of activations; checkpointed they are ~6.7 GB
    assert code == 0 and (result["recommended_stage"], result["activation_checkpointing"], result["offload"]) == (
        3, True, False)
    code, out, _ = run(capsys, "estimate", "--params", "13B", "--gpus", "8", "--tp", "8", *shape)
    assert "Recommended: ZeRO stage 3 with activation checkpointing" in out


@pytest.mark.parametrize("params", ["1e18", "1e15"])
def test_no_suggested_gpu_count_is_beyond_what_estimate_accepts(capsys, params):
    from hybrid.planner import MAX_GPUS

    code, out, err = run(capsys, "estimate", "--params", params, "--gpus", "8", "--gpu-memory", "0.5")
    assert code == 2 and out == "" and err.count("\n") == 1
    counts = [int(word) for word in err.replace("(", " ").split() if word.isdigit()]
    assert counts and all(n <= MAX_GPUS for n in counts), err
    assert f"more than {MAX_GPUS:,}" in err


def test_activations_too_large_name_their_own_fixes_not_the_gpu_count(capsys):
    code, out, err = run(capsys, "estimate", "--params", "1B", "--gpus", "8", "--layers", "24", "--hidden", "2048",
                         "--heads", "16", "--seq", "65536", "--micro-batch", "64")
    assert code == 2 and out == "" and err.count("\n") == 1
    assert err.startswith("error: activations with activation checkpointing alone need ") and "--gpus" not in err
    assert "(model.seq_len, --seq)" in err and "(job.micro_batch, --micro-batch)" in err
