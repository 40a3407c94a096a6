"""The quick calibration probe's pure parts (issue 44): the loaded collectives' fit, probe.json's figures without an
optimizer rate, the hardware and plan built from them, the launch's line and when a launch calibrates.

The probe itself runs on real ranks in tests/dist/test_probe_quick.py."""

import pytest

from launch.planning.plan import build_plan
from launch.planning.probe_figures import fit_line, fit_loaded, summarize
from launch.planning.probe_local import SWITCH, calibration_line, wanted
from launch.spec import parse_spec


def _spec(address="local", nodes=2, gpus=2):
    return parse_spec({"cluster": {"address": address, "nodes": nodes, "gpus_per_node": gpus, "gpu_memory_gb": 80,
                                   "interconnect": {"intra_node": "loopback", "inter_node": "loopback"}},
                       "job": {"entrypoint": "hybrid.models.gpt:train", "config": "configs/gpt-tiny.yaml",
                               "steps": 5, "micro_batch": 8},
                       "parallel": {"tp": 2, "zero_stage": 1, "precision": "fp32"}}, base_dir=".")


def _quick_rank(rank, small_s=2e-3, large_s=3e-3):
    group = {"size": 2, "loaded": True, "all_reduce": [[65536, small_s], [1 << 20, large_s]],
             "all_gather": [[65536, small_s], [1 << 20, large_s]]}
    return {"rank": rank, "node": rank // 2, "local_rank": rank % 2, "device": "cpu", "intra": group,
            "inter": group, "matmul_flops": 100e9, "op_rate": 1e5, "memory_bandwidth": 1e10, "host": "h",
            "cores": 2}


def test_a_loaded_call_is_mostly_waiting_so_its_latency_is_never_lost_to_noise():
    # a larger message that took longer: the ordinary line through the two points
    points = [(65536, 2e-3), (1 << 20, 3e-3)]
    assert fit_loaded(points) == fit_line(points)
    # one that did not: fit_line gives no latency at all; a loaded call keeps the small one's time as latency
    noisy = [(65536, 4e-3), (1 << 20, 2e-3)]
    assert fit_line(noisy)[0] == 0.0
    latency, bandwidth = fit_loaded(noisy)
    assert bandwidth == pytest.approx((1 << 20) / 2e-3)
    assert latency == pytest.approx(4e-3 - 65536 / bandwidth) and latency > 3.5e-3


def test_quick_figures_price_each_collective_at_its_loaded_latency_and_keep_the_table_optimizer():
    figures = summarize([_quick_rank(r) for r in range(4)], 2, 2, "fp32", "local (quick probe)")
    assert figures["optimizer_rate"] is None  # not measured: the table's rate stays
    assert figures["intra"]["loaded"] and figures["inter"]["loaded"]
    # all-reduce of 64 KB on 2 ranks: 64 KB of bus bytes; the line through (64 KB, 2 ms) and (1 MB, 3 ms)
    slope = (1 << 20) - 65536
    assert figures["intra"]["latency"] == pytest.approx(2e-3 - 65536 * 1e-3 / slope)
    lp = build_plan(_spec(), probe=figures)
    hw = lp.time.hardware
    assert hw.intra.latency == pytest.approx(figures["intra"]["latency"])
    assert "in training's rhythm" in hw.intra.source
    assert hw.optimizer_rate == pytest.approx(4.7e8)  # hybrid.plan.hardware.EFFICIENCY.host_adam
    # 13 TP all-reduces per micro-step (4 per block x 2 blocks, embedding, head, 3 of the loss) at that latency
    chosen = lp.time.chosen.cost
    assert chosen.terms["tp_calls"] == 13
    assert chosen.tp_s == pytest.approx(13 * hw.intra.latency + chosen.tp_bytes / hw.intra.bandwidth)
    # slower calls, a slower prediction: the table's 100 us could not see them
    slow = summarize([_quick_rank(r, 8e-3, 9e-3) for r in range(4)], 2, 2, "fp32")
    assert build_plan(_spec(), probe=slow).time.chosen.cost.step_s > chosen.step_s


def test_the_launch_line_says_what_was_measured_and_how_long_it_took():
    figures = summarize([_quick_rank(r) for r in range(4)], 2, 2, "fp32")
    figures.update(quick=True, seconds=3.21)
    line = calibration_line(figures)
    assert line.startswith("probe   calibrated on this machine in 3.2 s (2 x 2 CPU ranks")
    assert "inside a node 1.9 ms per call of 2 ranks" in line and "matmul 50 GFLOP/s" in line  # 100 / 2 ranks a core
    assert "20 us per eager op" in line
    assert calibration_line(None).endswith("did not finish (see the warning above); the plan uses the tables")


def test_only_an_embedded_cpu_cluster_calibrates_and_the_switch_turns_it_off(monkeypatch):
    monkeypatch.setenv(SWITCH, "1")
    assert wanted(_spec(), use_gpus=False)
    assert not wanted(_spec(), use_gpus=True)
    assert not wanted(_spec(address="auto"), use_gpus=False)
    for off in ("0", "off", "False"):
        monkeypatch.setenv(SWITCH, off)
        assert not wanted(_spec(), use_gpus=False)
