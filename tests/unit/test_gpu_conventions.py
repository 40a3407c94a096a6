"""The CUDA conventions as pure decisions, checked for machines this one is not: torchrun's variables per
rank, which GPUs a rank sees and which one it uses (shared, Ray Train's way, or isolated), the device
``run_local`` gives each rank for a fake GPU count, how a rank joins the default group on CUDA, the mesh's
node and local rank from the environment, the NCCL variables every rank gets, and ``job.isolate_gpus``."""

from datetime import timedelta
from pathlib import Path

import pytest
import torch

from hybrid.comm import mesh as mesh_module
from hybrid.errors import ConfigError
from hybrid.runtime.local_launch import local_rank_env, rank_device
from hybrid.comm.mesh import placement_from_env, process_group_backend, tp_groups_across_nodes
from launch.ray.runtime_env import rank_env as _rank_env
from launch.spec import parse_spec
from launch.ray.workers import PlacementFailed, RankPlacement, assign_ranks, cuda_devices, rank_env

ROOT = Path(__file__).resolve().parents[2]


def test_local_ranks_follow_the_gpu_ids_ray_gave_the_actors():
    # two nodes, actors listed in arbitrary order; Ray gave each one GPU of its node
    nodes = ["n-b", "n-a", "n-b", "n-a", "n-b", "n-a"]
    ips = ["10.0.0.2", "10.0.0.1"] * 3
    gpus = [["2"], ["10"], ["0"], ["1"], ["1"], ["2"]]
    ranks = assign_ranks(nodes, 3, ips, gpus)
    # node n-a (lower IP) holds ranks 0-2 by GPU id 1, 2, 10 (numeric order); n-b ranks 3-5 by 0, 1, 2
    assert ranks == [5, 2, 3, 0, 4, 1]
    assert assign_ranks(nodes, 3, ips) == [3, 0, 4, 1, 5, 2]  # no GPUs: actor order inside a node


def _placements(gpu_ids_per_rank, per_node):
    return [RankPlacement(rank=r, node_id=f"n{r // per_node}", ip="10.0.0.1", node_index=r // per_node,
                          local_rank=r % per_node, gpu_ids=tuple(ids)) for r, ids in enumerate(gpu_ids_per_rank)]


def test_the_ranks_of_a_node_share_its_gpus_and_use_cuda_local_rank_unless_isolated():
    # 2 nodes x 4 GPUs, the job given GPUs 4-7 on node 0 and 0-3 on node 1
    placement = _placements([["4"], ["5"], ["6"], ["7"], ["0"], ["1"], ["2"], ["3"]], per_node=4)
    for p in placement:
        node = [q for q in placement if q.node_index == p.node_index]
        visible, device = cuda_devices(p, node, isolate=False)
        assert visible == ("4,5,6,7" if p.node_index == 0 else "0,1,2,3")
        assert device == f"cuda:{p.local_rank}"
        assert cuda_devices(p, node, isolate=True) == (p.gpu_ids[0], "cuda:0")
    with pytest.raises(PlacementFailed, match="no GPU"):
        cuda_devices(_placements([[]], 1)[0], [], isolate=False)


def test_every_rank_gets_torchruns_variables():
    p = RankPlacement(rank=5, node_id="n1", ip="10.0.0.2", node_index=1, local_rank=1)
    assert rank_env(p, world_size=8, nodes=2, ranks_per_node=4, master_addr="10.0.0.1", master_port=29500) == {
        "RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4", "GROUP_RANK": "1",
        "NODE_RANK": "1", "GROUP_WORLD_SIZE": "2", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}


def test_run_local_puts_rank_r_on_cuda_r_and_refuses_more_ranks_than_gpus():
    assert [rank_device(r, 4, "nccl", device_count=8) for r in range(4)] == ["cuda:0", "cuda:1", "cuda:2", "cuda:3"]
    assert rank_device(1, 2, "gloo", device_count=0) == "cpu"
    with pytest.raises(ConfigError, match="world_size is 3 and this machine has 2 GPU"):
        rank_device(0, 3, "nccl", device_count=2)
    with pytest.raises(ConfigError, match="backend is 'mpi'"):
        rank_device(0, 1, "mpi", device_count=0)
    assert local_rank_env(2, 4) == {"RANK": "2", "WORLD_SIZE": "4", "LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "4",
                                    "GROUP_RANK": "0", "NODE_RANK": "0"}


def test_a_cuda_rank_binds_its_device_and_keeps_gloo_for_cpu_tensors(monkeypatch, tmp_path):
    calls = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: calls.append(("set_device", device)))
    monkeypatch.setattr(mesh_module.dist, "init_process_group",
                        lambda backend, **kw: calls.append(("init", backend, kw["device_id"], kw["rank"])))
    monkeypatch.setenv("TORCH_FR_DUMP_TEMP_FILE", str(tmp_path / "fr" / "rank_"))
    device = torch.device("cuda:3")
    mesh_module.init_default_group(device, rank=3, world_size=4, timeout=timedelta(seconds=5))
    assert calls == [("set_device", device), ("init", "cpu:gloo,cuda:nccl", device, 3)]
    assert (tmp_path / "fr").is_dir()  # where NCCL's flight recorder dumps on a timeout
    assert process_group_backend(torch.device("cpu")) == "gloo"


def test_the_mesh_takes_node_and_local_rank_from_the_launchers_environment():
    assert placement_from_env({"LOCAL_RANK": "1", "GROUP_RANK": "3"}, rank=7) == (3, 1)  # torchrun
    assert placement_from_env({"LOCAL_RANK": "0", "NODE_RANK": "1"}, rank=2) == (1, 0)
    assert placement_from_env({"LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "4"}, rank=6) == (1, 2)
    assert placement_from_env({}, rank=3) == (0, 3)  # nothing said: one node


def test_tp_groups_that_span_nodes_are_found():
    two_by_four = [0, 0, 0, 0, 1, 1, 1, 1]
    assert tp_groups_across_nodes(two_by_four, 4) == [] and tp_groups_across_nodes(two_by_four, 2) == []
    assert tp_groups_across_nodes(two_by_four, 8) == [(list(range(8)), [0, 1])]
    three_per_node = [0, 0, 0, 1, 1, 1]  # tp 2 does not divide 3 ranks per node: the middle group spans
    assert tp_groups_across_nodes(three_per_node, 2) == [([2, 3], [0, 1])]
    assert tp_groups_across_nodes([0, 1, 2, 3], 2) == [([0, 1], [0, 1]), ([2, 3], [2, 3])]  # a GPU per node


def _spec(**job):
    return parse_spec({"cluster": {"address": "local", "nodes": 2, "gpus_per_node": 2, "gpu_memory_gb": 80},
                       "job": {"entrypoint": "hybrid.models.gpt:train", "config": "configs/gpt-tiny.yaml",
                               "steps": 1, **job}}, base_dir=ROOT)


def test_ranks_get_the_nccl_defaults_the_flight_recorder_dir_and_the_drivers_nccl_variables(tmp_path):
    env = _rank_env(_spec(checkpoint={"dir": str(tmp_path)}),
                    {"NCCL_IB_HCA": "mlx5_0", "NCCL_DEBUG": "WARN", "PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:512",
                     "TORCH_FR_BUFFER_SIZE": "50", "TORCH_NCCL_TRACE_BUFFER_SIZE": "60", "HOME": "/root"})
    assert env["NCCL_IB_HCA"] == "mlx5_0" and env["NCCL_DEBUG"] == "WARN" and "HOME" not in env
    assert env["PYTORCH_CUDA_ALLOC_CONF"] == "max_split_size_mb:512"  # the driver's value wins
    assert env["TORCH_FR_BUFFER_SIZE"] == "50" and env["TORCH_NCCL_TRACE_BUFFER_SIZE"] == "60"
    assert env["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
    assert env["TORCH_FR_DUMP_TEMP_FILE"] == str(tmp_path / "nccl-flight-recorder" / "rank_")
    plain = _rank_env(_spec(), {})
    assert plain["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    assert plain["TORCH_FR_BUFFER_SIZE"] == "2000" and "TORCH_FR_DUMP_TEMP_FILE" not in plain


def test_ranks_of_the_embedded_cluster_get_the_drivers_proxy_settings_back():
    """The embedded head node starts with proxies on loopback (its dashboard asks cloud-metadata addresses); its
    raylet's ranks get the driver's own settings, none where it had none, and job.env over all."""
    mine = _rank_env(_spec(), {"https_proxy": "http://proxy.corp:3128", "no_proxy": ".corp"})
    assert mine["https_proxy"] == "http://proxy.corp:3128" and mine["no_proxy"] == ".corp"
    assert mine["http_proxy"] == mine["HTTP_PROXY"] == mine["NO_PROXY"] == ""
    none = _rank_env(_spec(), {})
    assert all(none[k] == "" for k in ("http_proxy", "HTTP_PROXY", "https_proxy", "HTTPS_PROXY", "no_proxy", "NO_PROXY"))
    assert _rank_env(_spec(env={"http_proxy": "http://job:1"}), {})["http_proxy"] == "http://job:1"


def test_job_isolate_gpus_is_a_boolean_defaulting_to_false():
    assert _spec().job.isolate_gpus is False and _spec(isolate_gpus=True).job.isolate_gpus is True
    with pytest.raises(ConfigError, match=r"^job\.isolate_gpus must be true or false, got 'yes'\.$"):
        _spec(isolate_gpus="yes")
