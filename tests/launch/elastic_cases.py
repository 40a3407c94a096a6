"""The elastic tests' job on paper (tests/unit/test_elastic.py, tests/launch/test_elastic_ray.py): the tiny GPT,
fp32, one rank per node, 12 sequences per step, and the per-GPU memory at which losing one of three nodes
changes its ZeRO stage (``parallel.offload: false``: else the plan would offload instead)."""

from pathlib import Path

from hybrid.plan.memory import GB
from hybrid.plan.monitor import NodeProbe
from launch.planning.plan import build_plan
from launch.ray.probe import NodeReport
from launch.spec import parse_spec

ROOT = Path(__file__).resolve().parents[2]
GLOBAL_BATCH, MICRO_BATCH = 12, 2


def job_spec(nodes: int, gpu_memory_gb: float = 80.0, elastic: dict | None = None, **job):
    """The job at ``nodes`` nodes, planned from declared facts (nothing contacts Ray)."""
    data = {"cluster": {"address": "local", "nodes": nodes, "gpus_per_node": 1, "gpu_memory_gb": gpu_memory_gb},
            "job": {"entrypoint": "hybrid.models.gpt:train", "config": str(ROOT / "configs" / "gpt-tiny.yaml"),
                    "steps": 10, "micro_batch": MICRO_BATCH, "global_batch": GLOBAL_BATCH, **job},
            "parallel": {"tp": 1, "precision": "fp32", "offload": False}}
    if elastic is not None:
        data["failure"] = {"elastic": elastic}
    return parse_spec(data, base_dir=ROOT)


def cpu_reports(nodes: int) -> list:
    """What the probe reports of ``nodes`` CPU nodes (no NVML)."""
    return [NodeReport(f"node{i}", "127.0.0.1", 1, 0, NodeProbe(False, "no NVML"), host_memory_bytes=16 * GB)
            for i in range(nodes)]


def stage_changing_memory_gb() -> float:
    """``cluster.gpu_memory_gb`` whose usable part lies midway between what the planner's memory model needs for
    ZeRO-1 (model states and activations) at DP 3 and at DP 2: stage 1 fits on 3 nodes, 2 nodes need stage 2."""
    needs = []
    for nodes in (3, 2):
        plan = build_plan(job_spec(nodes), cpu_reports(nodes)).plan
        needs.append(plan.stages[1].total + plan.activation_bytes)
        headroom = plan.headroom
    return sum(needs) / 2 / (1 - headroom) / GB
