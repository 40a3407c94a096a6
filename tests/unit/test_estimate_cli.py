"""`hybrid estimate` and `hybrid monitor`: the seed's table, the issue's JSON, one-line errors (exit 2)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from hybrid.plan.planner import ROW_STAGE1
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
        (["--params", "1,5B", "--gpus", "8"], "--params must be a count, got '1,5B'"),
        (["--params", "7B", "--gpus", "12", "--gpus-per-node", "8"], "multiple of --gpus-per-node (8)"),
        (["--params", "7B", "--gpus", "16", "--tp", "4", "--gpus-per-node", "6"], "--gpus-per-node (6) must be"),
        (["--params", "7B", "--gpus", "8", "--gpus-per-node", "0"], "--gpus-per-node must be"),
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
    from hybrid.config.yamlfile import load_yaml
    from launch.planning.plan import build_plan
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


@pytest.mark.slow  # two CLI processes, each importing torch: not in the fast tier (make test-fast)
def test_console_script_help_and_exit_codes():
    done = subprocess.run([HYBRID, "estimate", "--help"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "--micro-batch" in done.stdout and "--params" in done.stdout
    done = subprocess.run(
        [HYBRID, "estimate", "--gpus", "0", "--params", "7B"], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.splitlines() == ["error: --gpus must be a whole number from 1 to 10,000,000 (the total GPU count, "
                                        "DP × TP), got 0."]


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
    from hybrid.plan.planner import MAX_GPUS

    code, out, err = run(capsys, "estimate", "--params", params, "--gpus", "8", "--gpu-memory", "0.5")
    assert code == 2 and out == "" and err.count("\n") == 1
    import re

    counts = [int(n.replace(",", "")) for n in re.findall(r"(\d[\d,]*) (?:GPU|node)", err)]  # 8,888,889 GPUs
    assert counts and all(n <= MAX_GPUS for n in counts), err
    assert f"more than {MAX_GPUS:,}" in err


def test_activations_too_large_name_their_own_fixes_not_the_gpu_count(capsys):
    code, out, err = run(capsys, "estimate", "--params", "1B", "--gpus", "8", "--layers", "24", "--hidden", "2048",
                         "--heads", "16", "--seq", "65536", "--micro-batch", "64")
    assert code == 2 and out == "" and err.count("\n") == 1
    assert err.startswith("error: activations with activation checkpointing alone need ") and "--gpus" not in err
    assert "(model.seq_len, --seq)" in err and "(job.micro_batch, --micro-batch)" in err


# --- QA: separators in a parameter count, the ranks sharing a node's host memory, how counts read ---------


@pytest.mark.parametrize("text, count", [
    ("1,500,000", 1_500_000), ("1_500_000", 1_500_000), ("7_000_000", 7_000_000), ("1,000", 1000),
    ("1,300.5M", 1_300_500_000), ("+1,000", 1000), ("13B", 13 * 10**9), (" 2.5 B ", 2_500_000_000),
])
def test_thousands_groups_are_accepted(text, count):
    from hybrid.plan.memory import parse_count

    assert parse_count(text) == count


@pytest.mark.parametrize("text, fix", [
    ("1,5B", "write 1.5B."), ("1_5B", "write 1.5B."), ("1,2,3", "write the digits alone"),
    ("1,500_000", "write the digits alone"), ("1,000,00", "write the digits alone"), ("1000,000", "write the"),
    (",100", "write the"), ("1e1_0", "write the"), ("1.5,000", "write the"),
])
def test_other_separators_are_refused_in_one_sentence(text, fix):
    from hybrid.errors import ConfigError
    from hybrid.plan.memory import parse_count

    with pytest.raises(ConfigError) as err:
        parse_count(text, field="params in m.yaml")  # a model config's params: (launch.planning.model_size)
    message = str(err.value)
    assert message.startswith(f"params in m.yaml must be a count, got {text!r}: a comma or underscore may only "
                              "separate groups of three digits (1,500,000 or 1_500_000); ") and message.endswith(".")
    assert fix in message


def test_a_comma_in_params_never_changes_the_count(capsys):
    code, out, err = run(capsys, "estimate", "--params", "1,500,000,000", "--gpus", "8", "--json")
    assert code == 0 and json.loads(out)["params"] == 1_500_000_000


def test_the_tp_group_shares_a_nodes_host_memory(capsys):
    # TP 8 lies inside one node: its 8 ranks share the node's host memory (it said "x 1 = 122.5 GB per node")
    code, out, _ = run(capsys, "estimate", "--params", "70B", "--gpus", "8", "--tp", "8")
    assert code == 0 and "122.5 GB per rank x 8 = 980 GB per node" in out
    code, out, _ = run(capsys, "estimate", "--params", "70B", "--gpus", "32", "--tp", "8", "--gpus-per-node", "16",
                       "--gpu-memory", "20")
    assert code == 0 and "on 32 GPUs (2 nodes of 16): DP 4 × TP 8" in out
    assert "per rank x 16 = " in out and "per node" in out


def test_a_suggested_gpu_count_is_whole_nodes_when_the_node_size_is_given(capsys):
    code, out, err = run(capsys, "estimate", "--params", "700B", "--gpus", "8", "--tp", "2", "--gpus-per-node", "8")
    assert code == 2 and out == ""
    assert "use at least 5 nodes (40 GPUs) with the optimizer offloaded or at least 20 nodes (160 GPUs) without" in err
    code, out, err = run(capsys, "estimate", "--params", "700B", "--gpus", "8", "--tp", "2")
    assert "use at least 40 GPUs with the optimizer offloaded or at least 156 GPUs without" in err
    assert "node" not in err  # the node size is not known


def test_counts_read_as_numbers(capsys):
    code, out, _ = run(capsys, "estimate", "--params", "1", "--gpus", "1")
    assert code == 0 and out.startswith("1 parameter (bf16) on 1 GPU: DP 1 × TP 1, ")
    code, out, err = run(capsys, "estimate", "--params", "7B", "--gpus", "8", "--tp", "20000000")
    assert code == 2 and "from 1 to 10,000,000," in err
    code, out, err = run(capsys, "estimate", "--params", "1e18", "--gpus", "1", "--gpu-memory", "0.5")
    assert code == 2 and err.rstrip().endswith("use more than 10,000,000 GPUs, or GPUs with more memory.")
    assert "1 GPU (tp=1" in err


def test_a_prediction_of_another_model_than_params_says_so(capsys):
    """``--vocab`` adds the prediction of the built-in GPT of the shape: when ``--params`` is another count,
    the two tables describe two models, and the output says which is which."""
    shape = [x for kv in SHAPE_7B.items() for x in kv]
    code, out, _ = run(capsys, "estimate", "--params", "1B", "--gpus", "8", *shape, "--vocab", "50304")
    assert code == 0
    note = next(line for line in out.splitlines() if line.startswith("note: "))
    assert "built-in GPT of this shape, 6,864,642,048 parameters" in note and "1,000,000,000 parameters" in note
    code, out, _ = run(capsys, "estimate", "--params", "6864642048", "--gpus", "8", *shape, "--vocab", "50304")
    assert code == 0 and "note: " not in out
    code, out, _ = run(capsys, "estimate", "--params", "1B", "--gpus", "8", *shape, "--vocab", "50304", "--json")
    assert json.loads(out)["prediction_params"] == 6_864_642_048
