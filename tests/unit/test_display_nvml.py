"""The driver's live line (``launch.job.display.Progress``) with the NVML samples the ranks send: the latest
sample of each node (sent by its local rank 0, ``asdict(hybrid.plan.monitor.Sample)``) is shown as
``node@rankR U% USED/TOTAL`` -- used and total summed over the node's GPUs, the utilization averaged over the
GPUs that report one -- after the step's loss and memory, nodes in rank order."""

import io
from dataclasses import asdict

from hybrid.plan.monitor import GpuInfo, Sample
from launch.job.display import Progress

GB = 10**9


def _gpu(index, used_gb, total_gb, utilization):
    used, total = int(used_gb * GB), int(total_gb * GB)
    return GpuInfo(index, "NVIDIA H200", total, used, total - used, utilization, f"GPU-{index}")


def _step(step, rank, nvml=()):
    """What a rank's drain holds: its report of ``step`` and the NVML samples taken since the last drain."""
    report = {"rank": rank, "step": step, "loss": 2.0 + step / 10, "dp_rank": rank // 2, "tp_rank": rank % 2}
    return {"rank": rank, "reports": [report], "nvml": [asdict(s) for s in nvml]}


def _lines(progress) -> list:
    return progress.stream.getvalue().splitlines()


def test_the_live_line_shows_each_nodes_latest_nvml_sample():
    progress = Progress(total_steps=3, world_size=4, stream=io.StringIO(), tty=False)
    node0 = Sample(100.0, [_gpu(0, 10, 80, 50.0), _gpu(1, 20, 80, 30.0)])
    node1 = Sample(100.2, [_gpu(0, 1.5, 80, None)])  # a GPU without utilization (a MIG slice): no percentage
    for rank, samples in ((0, [node0]), (1, []), (2, [node1]), (3, [])):  # local rank 0 of each node samples
        progress.add(_step(1, rank, samples))
    # node 0: 10 + 20 GB of 80 + 80 GB, (50 + 30) / 2 % busy; node 1: 1.5 GB of 80 GB
    assert _lines(progress) == ["step 1/3  loss 2.1000  gpu node@rank0 40% 30 GB/160 GB, node@rank2 1.5 GB/80 GB"]

    later = Sample(101.0, [_gpu(0, 70, 80, 100.0), _gpu(1, 75.5, 80, 90.0)])
    progress.add(_step(2, 0, [node0, later]))  # two samples since the last drain: the latest counts
    for rank in (1, 2, 3):
        progress.add(_step(2, rank))  # no new sample from node 1: its last one stays
    assert _lines(progress)[-1] == \
        "step 2/3  loss 2.2000  gpu node@rank0 95% 145.5 GB/160 GB, node@rank2 1.5 GB/80 GB"


def test_no_nvml_no_gpu_part():
    progress = Progress(total_steps=1, world_size=2, stream=io.StringIO(), tty=False)
    progress.add(_step(1, 0, [Sample(1.0, [])]))  # NVML with no GPU (a CPU node)
    progress.add(_step(1, 1))
    assert _lines(progress) == ["step 1/1  loss 2.1000"]
