"""NVMe offload in the configs: zero.offload_optimizer {device: nvme, path} (DeepSpeed's nvme_path maps onto it),
the cluster file's parallel.offload: nvme with cluster.nvme_path / nvme_gb, the engine's swap file under the path
(removed by close), and the launcher's settings carrying the path to the ranks' training config."""

import copy
import os
import logging
from pathlib import Path

import pytest
import torch

from hybrid.config.training import OffloadConfig, TrainConfig, ZeroConfig
from hybrid.errors import ConfigError
from launch.spec import load_spec

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "configs" / "gpt-tiny.yaml"

DS_NVME = {  # DeepSpeed's documented ZeRO-Infinity optimizer offload, with its aio section
    "bf16": {"enabled": True},
    "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": "/local_nvme",
                                                            "pin_memory": True, "buffer_count": 4,
                                                            "fast_init": False},
                          "sub_group_size": 1e8},
    "aio": {"block_size": 262144, "queue_depth": 32, "thread_count": 1, "single_submit": False,
            "overlap_events": True},
}


def test_deepspeeds_nvme_offload_maps_onto_device_and_path(caplog):
    with caplog.at_level(logging.INFO, logger="hybrid.config.training"):
        cfg = TrainConfig.from_dict(copy.deepcopy(DS_NVME))
    off = cfg.zero.offload_optimizer
    assert (off.device, off.path, off.pin_memory, off.nvme, off.enabled) == ("nvme", Path("/local_nvme"), True, True,
                                                                            True)
    ignored = " ".join(r.getMessage() for r in caplog.records)
    assert "aio" in ignored and "zero_optimization.offload_optimizer.buffer_count" in ignored
    ours = TrainConfig.from_dict({"zero": {"stage": 2, "offload_optimizer": {"device": "nvme", "path": "/nvme/x"}}})
    assert ours.zero.offload_optimizer == OffloadConfig(device="nvme", path=Path("/nvme/x"))
    # DeepSpeed reads nvme_path only with device nvme: beside cpu it is not read (as before), ours is refused
    cpu = TrainConfig.from_dict({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu",
                                                                                         "nvme_path": "/nvme"}}})
    assert cpu.zero.offload_optimizer == OffloadConfig(device="cpu")


@pytest.mark.parametrize("offload, start", [
    ({"device": "nvme"}, "zero.offload_optimizer.device is nvme but zero.offload_optimizer.path is not set; set it "
                         "to a directory on the node's local NVMe disk"),
    ({"device": "nvme", "path": "local/nvme"}, "zero.offload_optimizer.path is 'local/nvme', a relative path; give "
                                               "the absolute path"),
    ({"device": "cpu", "path": "/nvme"}, "zero.offload_optimizer.path is set but zero.offload_optimizer.device is "
                                         "cpu; set zero.offload_optimizer.device to nvme"),
    ({"device": "disk"}, "zero.offload_optimizer.device must be one of none, cpu, nvme, got 'disk'."),
    ({"device": "nvme", "path": "/a", "nvme_path": "/b"}, "zero.offload_optimizer.path and "
                                                          "zero.offload_optimizer.nvme_path are both set"),
])
def test_each_bad_offload_is_one_sentence_naming_the_field(offload, start):
    with pytest.raises(ConfigError) as err:
        TrainConfig.from_dict({"zero": {"stage": 3, "offload_optimizer": offload}})
    assert str(err.value).startswith(start) and "\n" not in str(err.value), str(err.value)
    with pytest.raises(ConfigError, match="needs ZeRO stage 1, 2 or 3"):
        ZeroConfig(stage=0, offload_optimizer={"device": "nvme", "path": "/nvme"})


def test_the_engine_keeps_its_states_in_a_swap_file_under_the_path(tmp_path):
    import hybrid
    from hybrid.plan.swap_layout import swap_file

    config = TrainConfig.from_dict({"zero": {"stage": 1, "offload_optimizer": {"device": "nvme",
                                                                               "path": str(tmp_path)}}})
    engine = hybrid.initialize(torch.nn.Linear(4, 4), config)
    assert list(tmp_path.rglob("*.swap")) == [swap_file(tmp_path, f"pid{os.getpid()}", 0)]
    second = hybrid.initialize(torch.nn.Linear(4, 4), config)  # another engine in this process: its own file
    assert len(list(tmp_path.rglob("*.swap"))) == 2
    engine.backward(engine(torch.ones(2, 4)).sum())
    assert engine.step()
    engine.close()
    second.close()
    assert list(tmp_path.iterdir()) == []  # the files and the job's directory are gone


def cluster_file(tmp_path, cluster: str = "", parallel: str = "") -> Path:
    path = tmp_path / "c.yaml"
    path.write_text(f"cluster:\n  address: local\n  nodes: 1\n  gpus_per_node: 2\n  gpu_memory_gb: 80\n{cluster}"
                    f"job:\n  entrypoint: hybrid.models.gpt:train\n  config: {TINY}\n  steps: 2\n"
                    f"parallel:\n{parallel or '  tp: 1'}\n")
    return path


def test_the_cluster_file_declares_the_disk_and_the_lever_takes_nvme(tmp_path):
    spec = load_spec(cluster_file(tmp_path, f"  nvme_path: {tmp_path}\n  nvme_gb: 3840\n", "  offload: nvme"))
    assert (spec.parallel.offload, spec.cluster.nvme_path, spec.cluster.nvme_gb) == ("nvme", tmp_path, 3840)
    from hybrid.config.schema import echo

    assert echo(spec.parallel)["offload"] == "nvme"
    assert load_spec(cluster_file(tmp_path, parallel="  offload: auto")).parallel.offload is None


@pytest.mark.parametrize("cluster, parallel, start", [
    ("", "  offload: nvme", "parallel.offload is nvme but cluster.nvme_path is not set; set it to a directory on "
                            "each node's local NVMe disk"),
    ("  nvme_path: nvme\n", "", "cluster.nvme_path is 'nvme', a relative path; give the absolute path"),
    ("  nvme_gb: 100\n", "", "cluster.nvme_gb is set but cluster.nvme_path is not"),
    ("  nvme_path: /nvme\n  nvme_gb: 0\n", "", "cluster.nvme_gb must be"),
    ("  nvme_path: /nvme\n", "  offload: disk", "parallel.offload must be auto, true (host memory), nvme"),
    ("  nvme_path: /nvme\n", "  offload: nvme\n  zero_stage: 0", "parallel.offload is nvme but "
                                                                  "parallel.zero_stage is 0"),
])
def test_each_bad_cluster_key_is_one_sentence(tmp_path, cluster, parallel, start):
    with pytest.raises(ConfigError) as err:
        load_spec(cluster_file(tmp_path, cluster, parallel))
    assert str(err.value).startswith(start) and "\n" not in str(err.value), str(err.value)


def test_the_ranks_training_config_gets_the_disk_from_the_job_settings(tmp_path):
    from hybrid.models.sections import TRAIN_DEFAULTS, training_config

    config = training_config(TRAIN_DEFAULTS, 3, "bf16", offload="nvme", nvme_path=str(tmp_path))
    assert config.zero.offload_optimizer == OffloadConfig(device="nvme", path=tmp_path, pin_memory=True)
    assert training_config(TRAIN_DEFAULTS, 3, "bf16", offload=True).zero.offload_optimizer.device == "cpu"
    with pytest.raises(ConfigError, match="^the plan offloads the optimizer states to NVMe"):
        training_config(TRAIN_DEFAULTS, 3, "bf16", offload="nvme")
