"""Every config default is defined once: each section read from YAML, from a DeepSpeed dict (where it has a
DeepSpeed form) and built from keyword arguments with nothing set holds the same values, field by field; and
each section is checked once, on construction, under the path the user wrote (hybrid.config.schema)."""

import dataclasses
from collections import Counter
from pathlib import Path
from unittest import mock

import pytest
import yaml

from hybrid.config import schema
from hybrid.config.schema import Section
from hybrid.config.training import OffloadConfig, OptimizerConfig, SchedulerConfig, TrainConfig, ZeroConfig
from hybrid.errors import ConfigError
from hybrid.models.gpt.config import GPTConfig
from hybrid.models.sections import TrainOptions
from launch.spec import CheckpointSpec, ClusterSpec, JobSpec, ParallelSpec, load_spec

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "configs" / "gpt-tiny.yaml"
SECTIONS = (OffloadConfig, ZeroConfig, OptimizerConfig, SchedulerConfig, TrainConfig, ClusterSpec, CheckpointSpec,
            JobSpec, ParallelSpec, GPTConfig, TrainOptions)


def assert_same(*configs):
    """Every field of every config equal to the first's (named when not: a default set in one place only)."""
    first = configs[0]
    for other in configs[1:]:
        assert type(other) is type(first)
        for f in dataclasses.fields(first):
            assert getattr(other, f.name) == getattr(first, f.name), (type(first).__name__, f.name)


def from_yaml(text: str) -> dict:
    return yaml.safe_load(text)


def test_the_training_sections_read_from_yaml_from_deepspeed_and_built_with_nothing_set_agree():
    assert_same(ZeroConfig(), TrainConfig.from_dict(from_yaml("zero: {}")).zero,
                TrainConfig.from_dict({"zero_optimization": {}}).zero)
    assert_same(OffloadConfig(), ZeroConfig().offload_optimizer,
                TrainConfig.from_dict(from_yaml("zero: {stage: 1, offload_optimizer: {}}")).zero.offload_optimizer,
                TrainConfig.from_dict({"zero_optimization": {"stage": 1, "offload_optimizer": {}}})
                .zero.offload_optimizer)
    assert_same(OptimizerConfig(), TrainConfig().optimizer, TrainConfig.from_dict(from_yaml("optimizer: {}")).optimizer)
    # DeepSpeed's optimizer form has defaults of its own (weight decay 0, every parameter decayed), declared once
    assert schema.deepspeed_defaults(OptimizerConfig) == {"weight_decay": 0.0, "no_decay": "none"}
    assert_same(OptimizerConfig(**schema.deepspeed_defaults(OptimizerConfig)),
                TrainConfig.from_dict({"optimizer": {"type": "AdamW", "params": {}}}).optimizer,
                TrainConfig.from_dict(from_yaml("optimizer: {params: {}}")).optimizer)
    for kind, required in (("WarmupLR", {}), ("WarmupDecayLR", {"total_num_steps": 2000}),
                           ("WarmupCosineLR", {"total_num_steps": 2000})):
        assert_same(SchedulerConfig(kind, tuple(required.items())),
                    TrainConfig.from_dict({"scheduler": {"type": kind, "params": required}}).scheduler)
    assert_same(TrainConfig(), TrainConfig.from_dict({}), TrainConfig.from_dict(from_yaml("{}")),
                TrainConfig.from_dict({"zero_optimization": {}, "bf16": {"enabled": False}, "optimizer": None}))


CLUSTER = """\
cluster: {address: local, nodes: 2, gpus_per_node: 2, gpu_memory_gb: 80}
job: {entrypoint: "hybrid.models.gpt:train", config: CONFIG, steps: 5}
"""


def test_the_cluster_file_sections_read_from_yaml_and_built_with_nothing_set_agree(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "c.yaml"
    path.write_text(CLUSTER.replace("CONFIG", str(TINY)))
    spec = load_spec(path)
    assert_same(ClusterSpec("local", 2, 2, 80), spec.cluster)
    assert_same(ParallelSpec(), spec.parallel)
    assert_same(CheckpointSpec(), spec.job.checkpoint)
    # what a cluster file resolves against its own place: the working dir is the file's, the run dir runs/<name>
    assert_same(JobSpec("hybrid.models.gpt:train", TINY, 5, working_dir=tmp_path, run_dir=tmp_path / "runs" / "c"),
                spec.job)
    assert JobSpec("m:f", TINY, 5).working_dir == Path(schema.default_of(JobSpec, "working_dir"))


def test_a_checkpoint_dir_without_every_saves_every_10_steps_as_the_docs_show(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(CLUSTER.replace("CONFIG", str(TINY)).replace("steps: 5}", "steps: 5, checkpoint: {dir: run}}"))
    checkpoint = load_spec(path).job.checkpoint
    assert_same(CheckpointSpec(dir=tmp_path / "run"), checkpoint)
    assert checkpoint.every == CheckpointSpec().every == 10 and checkpoint.keep_last == 2
    page = (ROOT / "docs" / "checkpoints.md").read_text()
    assert "checkpoint: {dir: ../runs/demo, every: 10, keep_last: 2}" in page


def test_the_model_config_sections_read_from_yaml_and_built_with_nothing_set_agree():
    from hybrid.models.sections import TRAIN_DEFAULTS, train_options

    doc = from_yaml("model: {vocab_size: 256, seq_len: 32, n_layers: 2, hidden: 64, n_heads: 4}\ntrain: {}\n")
    assert_same(GPTConfig(256, 32, 2, 64, 4), GPTConfig.from_dict(doc["model"]))
    assert_same(TrainOptions(), schema.read(TrainOptions, doc["train"]))
    assert train_options(doc["train"]) == train_options(None) == TRAIN_DEFAULTS == schema.defaults(TrainOptions)


def test_every_field_of_every_section_is_declared_with_its_help():
    for cls in SECTIONS:
        for f in dataclasses.fields(cls):
            setting = f.metadata.get("hybrid.setting")
            assert setting is not None and setting.help, (cls.__name__, f.name)


def _count_constructions():
    counts = Counter()
    original = Section.__post_init__

    def counting(self, where):
        counts[type(self).__name__] += 1
        return original(self, where)

    return counts, mock.patch.object(Section, "__post_init__", counting)


def test_reading_a_config_checks_each_section_once():
    counts, patch = _count_constructions()
    with patch:
        TrainConfig.from_dict({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
                               "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
                               "scheduler": {"type": "WarmupLR"}})
    assert counts == {"TrainConfig": 1, "ZeroConfig": 1, "OffloadConfig": 1, "OptimizerConfig": 1,
                      "SchedulerConfig": 1}


def test_loading_a_cluster_file_checks_each_section_once(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(CLUSTER.replace("CONFIG", str(TINY)).replace("steps: 5}", "steps: 5, checkpoint: {dir: run}}"))
    counts, patch = _count_constructions()
    with patch:
        load_spec(path)
    assert counts == {"ClusterSpec": 1, "JobSpec": 1, "CheckpointSpec": 1, "ParallelSpec": 1, "FailureSpec": 1}


@pytest.mark.parametrize("build, start", [
    (lambda: ZeroConfig(stage=7), "zero.stage must be"),
    (lambda: TrainConfig.from_dict({"zero": {"stage": 7}}), "zero.stage must be"),
    (lambda: TrainConfig.from_dict({"zero_optimization": {"stage": 7}}), "zero_optimization.stage must be"),
    (lambda: TrainConfig.from_dict({"zero_optimization": {"stage3_prefetch_bucket_size": 0}}),
     "zero_optimization.prefetch_bucket_size must be"),
    (lambda: TrainConfig.from_dict({"optimizer": {"lr": -1}}), "optimizer.lr must be"),
    (lambda: TrainConfig.from_dict({"optimizer": {"type": "AdamW", "params": {"lr": -1}}}),
     "optimizer.params.lr must be"),
    (lambda: TrainConfig.from_dict({"optimizer": {"lr": -1}}, prefix="train."), "train.optimizer.lr must be"),
    (lambda: TrainConfig.from_dict({"train_micro_batch_size_per_gpu": 0}), "train_micro_batch_size_per_gpu must be"),
    (lambda: TrainConfig.from_dict({"micro_batch_size": 0}), "micro_batch_size must be"),
    (lambda: TrainConfig.from_dict({"optimizer": {"type": "Adam", "params": {"adam_w_mode": 3}}}),
     "optimizer.params.adam_w_mode must be true or false"),
    (lambda: TrainConfig.from_dict({"micro_batch_size": 1, "train_micro_batch_size_per_gpu": 1}),
     "micro_batch_size and train_micro_batch_size_per_gpu are both set"),
    (lambda: TrainConfig.from_dict({"optimizer": {"adam_w_mode": True, "decoupled_weight_decay": "x"}}),
     "optimizer.decoupled_weight_decay must be true or false"),
    (lambda: TrainConfig.from_dict({"scheduler": {"type": "WarmupLR", "params": [1]}}),
     "scheduler.params must be a mapping"),
    (lambda: TrainConfig.from_dict({"zero_optimization": {"reduce_dtype": "bf16"}}),
     "zero_optimization.reduce_dtype is bf16 but precision is fp32"),
])
def test_errors_name_the_path_the_user_wrote(build, start):
    with pytest.raises(ConfigError) as err:
        build()
    assert str(err.value).startswith(start), str(err.value)


def test_the_command_line_overrides_are_checked_under_the_flag(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(CLUSTER.replace("CONFIG", str(TINY)) + "parallel: {offload: true}\n")
    spec = load_spec(path)
    with pytest.raises(ConfigError, match=r"^--steps must be a whole number from 1 to"):
        spec.with_overrides(steps=0)
    with pytest.raises(ConfigError, match=r"^parallel\.offload is true but --stage is 0"):
        spec.with_overrides(stage=0)


def test_echo_is_what_a_user_writes_and_reads_back_to_the_same_section():
    assert schema.echo(ParallelSpec()) == {"tp": "auto", "zero_stage": "auto", "precision": "bf16", "offload": "auto",
                                           "activation_checkpointing": "auto"}
    cluster = ClusterSpec("ray://head:10001", 2, 8, 80, intra_node="nvlink", host_memory_gb=512)
    written = schema.echo(cluster)
    assert written["interconnect"] == {"intra_node": "nvlink", "inter_node": "unspecified"}
    assert schema.read(ClusterSpec, written) == cluster
    for section in (ParallelSpec(tp=2, zero_stage=3, offload=False), ZeroConfig(stage=3, reduce_dtype="fp32"),
                    GPTConfig(256, 32, 2, 64, 4, dropout=0.1)):
        assert schema.read(type(section), schema.echo(section)) == section
