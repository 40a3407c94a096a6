"""The stage-selection guide's next row: ZeRO-3 with the optimizer states offloaded to NVMe, where CPU offload does
not fit the host memory (hybrid.plan.planner, hybrid.plan.memory.nvme_offload_bytes), in `hybrid estimate` and in
the time model (hybrid.plan.cost: the swap file's read and write on the node's disk)."""

import json

import pytest

from hybrid.errors import ConfigError, PlanError
from hybrid.plan.cost import Layout, ModelShape, step_cost
from hybrid.plan.hardware import NVME, build_hardware, nvme_disk
from hybrid.plan.memory import nvme_offload_bytes, offload_bytes
from hybrid.plan.planner import ROW_NVME, ROW_NVME_AC, check_offload, choose_stage, layout_option
from hybrid.plan.layout import CONVERT_NUMEL
from hybrid.plan.swap_layout import swap_buffer_bytes
from launch.cli import main

GB, TB = 10**9, 10**12
T1 = 10**12


def test_nvme_bytes_keep_only_the_gradient_copy_and_the_buffers_in_host_memory():
    # 1T on 64 ranks in bf16: a shard of 15.625G parameters; 12 B each on disk, the 2 B gradient on the host
    split = nvme_offload_bytes(T1, 64, 3, precision="bf16")
    assert split.device == offload_bytes(T1, 64, 3, precision="bf16").device == 62.5 * GB
    assert split.disk == 187.5 * GB
    # three records of the optimizer's batches: bf16 gradients cap them at CONVERT_NUMEL elements (12 MB each)
    assert split.host == 31.25 * GB + swap_buffer_bytes(T1 // 64, CONVERT_NUMEL)
    small = nvme_offload_bytes(T1, 64, 3, precision="bf16", sub_group_size=10**5)  # smaller records, smaller buffers
    assert small.host < split.host and small.disk == split.disk
    fp32 = nvme_offload_bytes(T1, 64, 3, precision="fp32", sub_group_size=10**8)
    assert fp32.host == 62.5 * GB + swap_buffer_bytes(T1 // 64, 10**8)  # the fp32 gradient copy
    with pytest.raises(ConfigError, match="offload needs ZeRO stage 1, 2 or 3"):
        nvme_offload_bytes(T1, 64, 0)


def acceptance(**kwargs):
    return choose_stage(T1, 64, 1, 80 * GB, "bf16", host_memory_bytes=1 * TB, ranks_per_node=8, **kwargs)


def test_1t_on_8_nodes_with_1tb_hosts_takes_the_nvme_row():
    plan = acceptance(nvme=True)
    assert (plan.stage, plan.offload, plan.nvme, plan.offload_device) == (3, True, True, "nvme")
    assert plan.disk_bytes == 187.5 * GB and plan.disk_bytes_per_node == 1.5 * TB
    assert plan.per_gpu_bytes == 62.5 * GB
    assert plan.reason.startswith(f"{ROW_NVME}: stage 3 needs 250 GB, 62.5 GB with the optimizer off the GPU, of "
                                  "72 GB usable per GPU; CPU offload needs 1750 GB of host memory per node, 900 GB "
                                  "usable; host: 31.288 GB per rank x 8 = 250.302 GB of 900 GB usable per node; disk not "
                                  "checked (unknown): the swap files need 187.5 GB per rank x 8 = 1500 GB per node")
    assert [o.label for o in plan.options] == ["0", "1", "2", "3", "3 + offload", "3 + nvme"]
    # the disk known: checked, with the same headroom as the host memory
    plan = acceptance(nvme=True, nvme_bytes=2 * TB)
    assert plan.nvme and plan.reason.endswith("disk: 187.5 GB per rank x 8 = 1500 GB of 1800 GB usable per node")


def test_without_a_disk_auto_keeps_the_host_error_and_names_the_disk_as_a_way_out():
    with pytest.raises(PlanError) as err:
        acceptance()
    assert str(err.value).endswith("or nodes with more host memory (cluster.host_memory_gb), or an NVMe disk for the "
                                   "optimizer states (cluster.nvme_path).")
    with pytest.raises(PlanError) as err:  # forced to host memory: the host is what is too small, as before
        acceptance(offload=True)
    assert "offloaded to CPU" in str(err.value) and "NVMe" not in str(err.value)


def test_a_disk_too_small_is_said_with_the_nodes_that_would_do():
    with pytest.raises(PlanError) as err:
        acceptance(nvme=True, nvme_bytes=1 * TB)
    assert str(err.value) == (
        "1,000,000,000,000 parameters fit on the GPUs and in host memory only with the optimizer states offloaded to "
        "NVMe (ZeRO-3 + nvme), but a node's 8 ranks need 187.5 GB each = 1500 GB of disk and a node has 900 GB usable "
        "there: use at least 14 nodes (112 GPUs), as more DP ranks shard the states further, or a larger disk "
        "(cluster.nvme_path, cluster.nvme_gb).")
    # at the count it names, the disk holds them
    assert choose_stage(T1, 112, 1, 80 * GB, "bf16", host_memory_bytes=TB, ranks_per_node=8, nvme=True,
                        nvme_bytes=TB).nvme


def test_nvme_forced_takes_the_lowest_stage_and_every_option_offloads_there():
    plan = choose_stage(10**9, 8, 1, 10 * GB, headroom=0, offload="nvme")  # stage 1: 2 + 2 GB on the GPU
    assert (plan.stage, plan.nvme) == (1, True)
    assert plan.reason.startswith("stage 1 with the optimizer states offloaded to NVMe as requested "
                                  "(parallel.offload: nvme): stage 1 needs 5.5 GB, 4 GB with the optimizer off the GPU")
    assert all(o.nvme for o in plan.options)
    plan = choose_stage(10**9, 8, 1, 10 * GB, headroom=0, offload="nvme", forced_stage=3)
    assert plan.nvme and plan.reason.startswith("stage 3 as requested with the optimizer offloaded to NVMe: needs "
                                                "500 MB of 10 GB usable per GPU; host memory not checked")
    assert "; disk not checked (unknown): the swap files need 1.5 GB per rank x 1 = 1.5 GB per node" in plan.reason
    with pytest.raises(ConfigError, match="^offload is nvme but zero stage is 0"):
        choose_stage(10**9, 8, 1, 10 * GB, offload="nvme", forced_stage=0)
    with pytest.raises(ConfigError, match=r"^offload must be auto, true \(host memory\), nvme"):
        check_offload("offload", "disk")


def test_nvme_with_activation_checkpointing_is_the_last_row():
    # 1B on 8 GPUs of 10 GB, a 1 GB host: CPU offload's 1.75 GB per rank does not fit; NVMe needs 20 GB of
    # activations on the GPU without checkpointing, 8.5 GB with it
    plan = choose_stage(10**9, 8, 1, 10 * GB, headroom=0, activation_bytes=20 * GB,
                        checkpointed_activation_bytes=8.5 * GB, host_memory_bytes=1 * GB, nvme=True,
                        sub_group_size=10**6)
    assert (plan.stage, plan.nvme, plan.activation_checkpointing) == (3, True, True)
    assert plan.reason.startswith(ROW_NVME_AC)
    assert [o.label for o in plan.options][-4:] == ["3 + offload", "3 + offload + AC", "3 + nvme", "3 + nvme + AC"]


def test_nvme_alone_with_its_host_share_too_large_names_the_gpus_that_would_do():
    # forced to NVMe with a host too small even for the gradient copy and the buffers (a fixed 3 records)
    with pytest.raises(PlanError) as err:
        choose_stage(10**11, 8, 1, 80 * GB, offload="nvme", host_memory_bytes=20 * GB, ranks_per_node=8,
                     sub_group_size=10**8)
    message = str(err.value)
    assert message.startswith("100,000,000,000 parameters fit on the GPUs only with the optimizer states offloaded "
                              "to NVMe (ZeRO-3 + nvme), but a node's 8 ranks need ")
    assert "of host memory (their gradient shards and swap buffers) and a node has 18 GB usable" in message
    # the buffers do not shrink with DP until the shard is smaller than a sub-group: the sentence names both ways
    assert message.endswith("or nodes with more host memory (cluster.host_memory_gb), or a smaller "
                            "zero.sub_group_size (the swap buffers hold three of its records).")


def test_layout_option_sizes_nvme_like_the_planner():
    o = layout_option(T1, 64, 1, 3, 80 * GB, "bf16", offload=True, nvme=True, host_memory_bytes=TB,
                      ranks_per_node=8, nvme_bytes=TB)
    assert o.nvme and o.disk_bytes == 187.5 * GB and o.host_fits and o.disk_fits is False and not o.fits
    cpu = layout_option(T1, 64, 1, 3, 80 * GB, "bf16", offload=True, host_memory_bytes=TB, ranks_per_node=8)
    assert not cpu.nvme and cpu.host_fits is False


def test_the_time_model_reads_and_writes_the_swap_file_once_per_step():
    model = ModelShape(T1, 128, 25600, 160, 2048, 50_000)
    hw = build_hardware("H100", "bf16", "nvlink", "infiniband", 8)
    assert hw.nvme == nvme_disk() and dict(hw.sources)["nvme"].startswith("44.8 GB/s read, 24.3 GB/s write per node")
    cpu = step_cost(model, Layout(8, 8, 1, 3, 1, 1, True, True, "bf16"), hw)
    nvme = step_cost(model, Layout(8, 8, 1, 3, 1, 1, True, True, "bf16", nvme=True), hw)
    shard = T1 / 64
    assert nvme.nvme_read_bytes == nvme.nvme_write_bytes == 12 * shard
    disk = 12 * shard * 8 / (NVME.read * 8 * 0.8) + 12 * shard * 8 / (NVME.write * 8 * 0.8)
    assert nvme.nvme_s == pytest.approx(disk)
    host = shard / hw.host_adam_rate
    assert nvme.offload_s - cpu.offload_s == pytest.approx(max(host, disk) - host)  # the pipeline hides the faster
    assert cpu.nvme_s == 0 and nvme.layout.label.endswith(" nvme") and nvme.as_dict()["nvme_read_bytes"] == 12 * shard


def estimate(capsys, *argv):
    code = main(["estimate", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_hybrid_estimate_1t_on_64_gpus_with_1tb_hosts_picks_nvme_and_says_the_disk_bytes(capsys):
    argv = ("--params", "1T", "--gpus", "64", "--gpus-per-node", "8", "--host-memory", "1TB")
    code, out, err = estimate(capsys, *argv)
    assert code == 0 and err == ""
    assert "Per GPU           16000 GB       4187.5 GB  2218.75 GB  250 GB" in out  # stage 3: 250 GB per GPU
    assert "Recommended: ZeRO stage 3 with NVMe offload of optimizer states" in out
    assert "CPU offload needs 1750 GB of host memory per node, 900 GB usable" in out
    assert ("NVMe:    187.5 GB per rank x 8 = 1500 GB per node of swap files; each step reads and writes 187.5 GB "
            "per rank (1500 GB per node) each way") in out
    code, out, _ = estimate(capsys, *argv, "--nvme", "3.84TB", "--json")
    result = json.loads(out)
    assert (result["recommended_stage"], result["offload"], result["offload_device"]) == (3, True, "nvme")
    assert result["nvme"] == {"disk_bytes_per_rank": 187.5 * GB, "disk_bytes_per_node": 1.5 * TB,
                              "read_bytes_per_step": 187.5 * GB, "write_bytes_per_step": 187.5 * GB}
    code, _, err = estimate(capsys, *argv, "--nvme", "1000")  # GB: 900 usable, 1.5 TB needed
    assert code == 2 and "a node's 8 ranks need 187.5 GB each = 1500 GB of disk" in err
    code, _, err = estimate(capsys, *argv[:-1], "lots")
    assert code == 2 and err.startswith("error: --host-memory must be a size per node such as 1TB, 512GB or 768 (GB)")
