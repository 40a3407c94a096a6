"""cluster.yaml validation: the shipped files load; every bad field is one sentence and exit status 2."""

from pathlib import Path

import pytest

from hybrid.errors import ConfigError
from launch.cli import main
from launch.spec import load_spec

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "configs" / "gpt-tiny.yaml"

GOOD = f"""\
cluster:
  address: local
  nodes: 2
  gpus_per_node: 2
  gpu_memory_gb: 80
job:
  entrypoint: hybrid.models.gpt:train
  config: {TINY}
  steps: 5
parallel:
  tp: auto
  zero_stage: auto
"""


def test_shipped_cluster_files_load_with_paths_resolved_against_the_file():
    local = load_spec(ROOT / "clusters" / "local.yaml")
    assert (local.cluster.address, local.cluster.nodes, local.cluster.gpus_per_node) == ("local", 2, 2)
    assert local.job.config == ROOT / "configs" / "gpt-tiny-text.yaml"  # relative to clusters/
    assert (local.tp, local.dp, local.parallel.zero_stage) == (2, 2, None)
    dgx = load_spec(ROOT / "clusters" / "dgx-h100-8x8.yaml")
    assert (dgx.cluster.address, dgx.cluster.nodes, dgx.cluster.gpus_per_node, dgx.tp, dgx.dp) == ("auto", 8, 8, 8, 8)
    assert dgx.job.checkpoint.dir == ROOT / "runs" / "gpt-13b"


def test_an_empty_value_is_the_field_left_unset_for_every_field(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(GOOD)
    defaults = load_spec(path)
    empty = GOOD.replace("  tp: auto\n  zero_stage: auto\n", "  tp:\n  zero_stage:\n  precision:\n  offload:\n") + (
        "  activation_checkpointing:\n")
    empty = empty.replace("  steps: 5\n", "  steps: 5\n  micro_batch:\n  seed:\n  max_failures:\n  checkpoint:\n"
                                           "  collective_timeout_s:\n  run_dir:\n  working_dir:\n")
    empty = empty.replace("  gpu_memory_gb: 80\n", "  gpu_memory_gb: 80\n  interconnect: {intra_node: null}\n"
                                                   "  connect_timeout_s:\n  runtime_reserve_gb:\n")
    path.write_text(empty)
    assert load_spec(path) == defaults
    path.write_text(GOOD.replace("steps: 5", "steps:"))  # a required field left empty is missing
    with pytest.raises(ConfigError, match=r"^job\.steps is missing; add it \(the number of training steps\)\.$"):
        load_spec(path)


def test_overrides_and_defaults(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(GOOD)
    spec = load_spec(path)
    assert spec.job.micro_batch == 8 and spec.job.max_failures == 0 and spec.job.checkpoint.dir is None
    assert spec.parallel.precision == "bf16"
    changed = spec.with_overrides(steps=9, stage=3)
    assert (changed.job.steps, changed.parallel.zero_stage) == (9, 3)
    with pytest.raises(ConfigError, match="--steps"):
        spec.with_overrides(steps=0)


def _replace(old: str, new: str) -> str:
    assert old in GOOD
    return GOOD.replace(old, new)


BAD = {
    "missing field": (_replace("  nodes: 2\n", ""), "cluster.nodes is missing"),
    "tp does not divide": (_replace("tp: auto", "tp: 3"), "parallel.tp is 3"),
    "unknown key": (_replace("  steps: 5\n", "  steps: 5\n  stpes: 7\n"), "job.stpes is not a known setting"),
    "entrypoint not importable": (_replace("hybrid.models.gpt:train", "no_such_pkg.mod:train"),
                                  "job.entrypoint is 'no_such_pkg.mod:train'"),
    "no such function": (_replace("hybrid.models.gpt:train", "hybrid.models.gpt:nope"), "has no function 'nope'"),
    "nodes 0": (_replace("nodes: 2", "nodes: 0"), "cluster.nodes must be a whole number from 1 to 100000, got 0"),
    "world too large": (_replace("nodes: 2", "nodes: 100000").replace("gpus_per_node: 2", "gpus_per_node: 1024"),
                        "cluster.nodes x cluster.gpus_per_node is 100000 x 1024 = 102400000 ranks, above the "
                        "1048576 hybrid plans for; lower cluster.nodes or cluster.gpus_per_node."),
    "yaml syntax": (_replace("  steps: 5\n", "  steps: [5\n"), "line "),
    "bad stage": (_replace("zero_stage: auto", "zero_stage: 4"),
                  "parallel.zero_stage must be 'auto' or 0, 1, 2 or 3, got 4"),
    "bad address": (_replace("address: local", "address: 10.0.0.1"), "cluster.address must be 'local'"),
    "bad precision": (_replace("  zero_stage: auto\n", "  zero_stage: auto\n  precision: fp8\n"),
                      "parallel.precision must be one of bf16, fp32, got 'fp8'"),
    "missing model config": (_replace(str(TINY), "nothere.yaml"), "job.config is 'nothere.yaml'"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_cluster_file_is_one_sentence_and_exit_2(case, tmp_path, capsys):
    text, expected = BAD[case]
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    assert main(["plan", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith("error: ") and expected in err, err
    assert "Traceback" not in err


def test_yaml_syntax_error_names_the_line(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text(_replace("  steps: 5\n", "  steps: [5\n"))
    with pytest.raises(ConfigError, match=r"line (1[0-9]|[89])\b"):
        load_spec(path)


def test_launch_rejects_the_same_files_before_starting_ray(tmp_path, capsys):
    path = tmp_path / "bad.yaml"
    path.write_text(_replace("nodes: 2", "nodes: 0"))
    assert main(["launch", str(path)]) == 2
    assert "cluster.nodes must be" in capsys.readouterr().err


def test_a_nul_in_an_env_value_and_a_module_the_toolkit_shadows_are_one_sentence(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(GOOD.replace("  steps: 5\n", '  steps: 5\n  env: {A: "x\\0y"}\n'))
    with pytest.raises(ConfigError, match=r"^job\.env\.A must be a string \(without a NUL character\) or a number, "):
        load_spec(path)
    (tmp_path / "launch.py").write_text("def train(ctx):\n    return 1\n")  # the toolkit's launch package wins
    path.write_text(GOOD.replace("hybrid.models.gpt:train", "launch:train"))
    with pytest.raises(ConfigError, match=r"^job\.entrypoint is 'launch:train', but the module name 'launch' is "
                                          r"already taken by .*, which is imported instead of job\.working_dir's "
                                          r"'launch\.py'; rename yours"):
        load_spec(path)
