"""``hybrid probe``'s measurement on real rank actors (the package's embedded cluster: 2 nodes x 2 CPU ranks,
gloo): every rank measures at once, the figures come back whole, ``probe.json`` round-trips, and the plan
takes them instead of the tables -- then a launch of that plan prints predicted against measured step time."""

import io
import json
import re
from pathlib import Path

import pytest

from launch.job.driver import plan_and_run
from launch.planning.plan import build_plan
from launch.planning.probe_figures import read_probe, write_probe
from launch.ray.rank_probe import run_probe
from launch.spec import parse_spec

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


def spec_for(run_dir: Path):
    return parse_spec({
        "cluster": {"address": "local", "nodes": 2, "gpus_per_node": 2, "gpu_memory_gb": 80,
                    "interconnect": {"intra_node": "loopback", "inter_node": "loopback"}},
        "job": {"entrypoint": "hybrid.models.gpt:train", "config": "configs/gpt-tiny.yaml", "steps": 6,
                "run_dir": str(run_dir), "global_batch": 16, "collective_timeout_s": 120},
        "parallel": {"precision": "fp32"},
    }, base_dir=ROOT)


def test_the_probe_measures_on_every_rank_and_the_plan_and_the_launch_use_it(cluster, tmp_path):
    spec = spec_for(tmp_path / "run")
    figures = run_probe(spec, use_gpus=False)
    assert [r["rank"] for r in figures["ranks"]] == [0, 1, 2, 3] and figures["device"] == "cpu"
    for key in ("intra", "inter"):  # a node's 2 ranks; the 2 nodes' ranks of one local rank
        group = figures[key]
        assert (group["group_size"], group["concurrent_groups"]) == (2, 2)
        assert group["bandwidth"] > 0 and group["latency"] >= 0
        assert all(t > 0 for op in ("all_reduce", "all_gather") for _, t in group[op]["points"])
    assert figures["matmul_flops"]["fp32"] > 1e8 and figures["optimizer_rate"] > 1e5
    write_probe(spec.job.run_dir, figures)
    assert read_probe(spec.job.run_dir, spec) == json.loads(json.dumps(figures))
    lp = build_plan(spec, probe=figures)
    assert lp.time.hardware.peak_flops == figures["matmul_flops"]["fp32"]
    assert "measured by hybrid probe" in lp.time.note
    out = io.StringIO()
    result = plan_and_run(spec, out, tty=False)  # reads the run dir's probe.json
    text = out.getvalue()
    assert "measured by hybrid probe" in text and result.plan.rows * result.plan.layout.dp == 16
    assert re.search(r"step time: predicted [\d.]+ m?s \(tp\d z\d mb \d+.*\), measured [\d.]+ m?s \(median of \d+ "
                     r"steps\): measured / predicted = [\d.]+", text), text
    record = json.loads((tmp_path / "run" / "time.json").read_text())
    assert record["predicted_step_s"] > 0 and record["measured_step_s"] > 0
    assert all(e["predicted_step_s"] == record["predicted_step_s"] for e in result.history)
