"""The GPU tests' worker (``tests.gpu.worker``) on this CPU, so the code the GPU machine runs cannot rot
where there is no GPU: one gloo rank with torchrun's variables, engine parity at stages 0 and 3 in fp32
and bf16 within the GPU tests' tolerances, checkpoint save/resume continuing the run exactly, and the levers --
offload keeps every optimizer state in host memory (the engine's report: none on the device) and trains as the
same run without offload does."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.gpu.worker import LEVERS, TOLERANCE, offloaded

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow
TINY_PARAMS = 134_912  # configs/gpt-tiny.yaml


def test_the_gpu_worker_runs_its_parity_and_checkpoint_cases_on_cpu(tmp_path):
    out = tmp_path / "result.json"
    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "GLOO_SOCKET_IFNAME": "lo",
           "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-m", "tests.gpu.worker", str(out), "--cases", "parity,memory,checkpoint,levers",
                           "--stages", "0,3", "--init-method", f"file://{tmp_path / 'store'}",
                           "--checkpoint-dir", str(tmp_path / "checkpoints")],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(out.read_text())
    assert result["device"] == "cpu" and result["memory"] == {"skipped": "no CUDA device"}
    cases = {k: v for k, v in result["parity"].items() if k != "reference_losses"}
    assert sorted(cases) == [f"tp1xdp1/stage{s}/{p}" for s in (0, 3) for p in ("bf16", "fp32")]
    for name, case in cases.items():
        precision = name.rsplit("/", 1)[1]
        assert case["loss_err"] < TOLERANCE[precision]["loss"], (name, case)
        assert precision == "bf16" or case["weights_err"] < TOLERANCE["fp32"]["weights"], (name, case)
    ref = result["parity"]["reference_losses"]
    assert ref[-1] < ref[0], "the reference must learn, or parity says little"
    assert sorted(result["levers"]) == sorted(LEVERS)
    for name, case in result["levers"].items():
        precision = name.rsplit("/", 1)[1]
        assert case["loss_err"] < TOLERANCE[precision]["loss"], (name, case)
        assert precision == "bf16" or case["weights_err"] < TOLERANCE["fp32"]["weights"], (name, case)
        # where the optimizer states are, by the engine's report: Adam's moments (8 bytes per parameter) and,
        # in bf16, the fp32 master (4 more) -- on the device, or all 12 in host memory when offloaded
        memory, device_states = case["memory"], (8 if precision == "fp32" else 12) * TINY_PARAMS
        assert memory["devices"] == ["cpu"] and memory["pinned"] is None  # CPU: nothing to pin
        if offloaded(LEVERS[name][2]):
            assert memory["report"]["optimizer"] == 0 and memory["report"]["host"]["optimizer"] == 12 * TINY_PARAMS
            plain = case["without_offload"]
            assert "host" not in plain["memory"]["report"]
            assert plain["memory"]["report"]["optimizer"] == device_states, (name, plain["memory"])
            assert case["losses"][:2] == pytest.approx(plain["losses"], rel=1e-6)  # the same arithmetic
        else:
            assert "host" not in memory["report"] and "without_offload" not in case
            assert memory["report"]["optimizer"] == device_states, (name, memory)
    assert sum(offloaded(zero) for _, _, zero, _ in LEVERS.values()) == 3
    c = result["checkpoint"]
    assert c["first"] + c["rest"] == c["whole"] and c["weights_err"] == 0.0
