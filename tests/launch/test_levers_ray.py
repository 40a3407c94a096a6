"""The plan's levers on a real embedded Ray cluster (2 nodes × 2 ranks, loopback only), shared by the module.

* Bring your own model: the README's examples/own_model (a plain PyTorch model, found through its module's
  ``build_model`` hook) runs under ``tp: auto`` with tp = 1 and DP over all 4 ranks: every rank is its own DP
  rank, sees its own data and reports its own loss, and the loss falls.
* Offload: with ``gpu_memory_gb`` so small that only ZeRO-3 with the optimizer offloaded to CPU fits, the
  launcher runs that plan (nothing the planner picks is refused), the job trains to the end, and every rank's
  optimizer states are in its host memory: its engine's memory report (none on the device, the shard's
  master and moments under ``host``, the plan's host bytes) and its own process's measured growth.
"""

import io
from pathlib import Path

import pytest

from launch.job.driver import plan_and_run
from launch.planning.plan import build_plan
from launch.spec import load_spec, parse_spec

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
NODES, RANKS_PER_NODE = 2, 2
# gpt-tiny in fp32 at tp 2, dp 2, micro-batch 8: ZeRO-3 needs 2.226 MB per GPU, offloaded 1.957 MB (the
# activations, its profile's, are 1.687 MB); 2.07 MB usable (0.0023 GB less 10%) leaves only the offloaded plan.
ONLY_OFFLOAD_GB = 0.0023
TINY_PARAMS = 134_912  # configs/gpt-tiny.yaml


def test_own_model_without_tp_layers_runs_with_tp_1_and_dp_over_all_ranks(cluster):
    assert "examples/own_model/cluster.yaml" in (ROOT / "README.md").read_text()
    spec = load_spec(ROOT / "examples" / "own_model" / "cluster.yaml")
    assert spec.parallel.tp is None  # tp: auto
    out = io.StringIO()
    result = plan_and_run(spec, out, tty=False)
    text = out.getvalue()
    assert (result.plan.layout.tp, result.plan.layout.dp) == (1, 4), text
    assert "tp=1 (inside a node), dp=4" in text and "since the model has no tensor-parallel layers" in text
    assert "counted on the meta device by my_model.build_model" in text
    assert all((r["tp"], r["dp"]) == (1, 4) for r in result.results.values())
    last = [result.last_reports[r]["loss"] for r in range(4)]
    assert len(set(last)) == 4, last  # four DP ranks on four slices of the batch, not TP copies of one
    losses = [h["loss"] for h in result.history]
    assert len(losses) == spec.job.steps and losses[-1] < losses[0] - 1.0, losses


def test_a_plan_that_fits_only_with_offload_trains_to_the_end_with_its_states_in_host_memory(cluster, tmp_path):
    spec = parse_spec({
        "cluster": {"address": "local", "nodes": NODES, "gpus_per_node": RANKS_PER_NODE,
                    "gpu_memory_gb": ONLY_OFFLOAD_GB},
        "job": {"entrypoint": "hybrid.models.gpt:train", "config": "configs/gpt-tiny.yaml", "steps": 20,
                "micro_batch": 8, "collective_timeout_s": 60},
        "parallel": {"tp": 2, "zero_stage": "auto", "precision": "fp32", "activation_checkpointing": False},
    }, base_dir=ROOT)
    offline = build_plan(spec)
    assert (offline.stage, offline.plan.offload) == (3, True) and not any(offline.plan.fits.values())
    out = io.StringIO()
    result = plan_and_run(spec, out, tty=False)
    assert "ZeRO-3 with optimizer states offloaded to CPU" in out.getvalue()
    assert all(r["stage"] == 3 for r in result.results.values())
    losses = [h["loss"] for h in result.history]
    assert len(losses) == 20 and losses[-1] < losses[0] - 1.0, losses
    # In every rank, as measured there after the last step: its engine holds no optimizer state on the device;
    # in host memory the fp32 master and Adam's two moments of its shard (12 bytes per element: 134,912
    # parameters / tp 2 / dp 2, plus the units' alignment padding) beside the gradient shard's fp32 copy (4 bytes
    # per element) -- the plan's host bytes per rank, to the padding --, and its own process grew by that much.
    shard = TINY_PARAMS // (2 * 2)
    for rank in range(NODES * RANKS_PER_NODE):
        report = result.last_reports[rank]
        memory, measured = report["memory"], report["memory_measured"]
        assert memory["optimizer"] == 0 and "host" in memory, (rank, memory)
        host = memory["host"]
        assert host["optimizer"] == 3 * host["grads"], (rank, host)
        assert 12 * shard <= host["optimizer"] <= 1.03 * 12 * shard, (rank, host)
        assert host["optimizer"] + host["grads"] == pytest.approx(offline.plan.host_bytes, rel=0.03), (rank, host)
        assert report["step"] == 20 and measured["device"] == "cpu", (rank, report["step"], measured)
        assert measured["peak_bytes"] >= host["optimizer"] + host["grads"], (rank, measured, host)
