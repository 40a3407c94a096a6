"""The GPU tests' worker (``tests.gpu.worker``) on this CPU, so the code the GPU machine runs cannot rot
where there is no GPU: one gloo rank with torchrun's variables, engine parity at stages 0 and 3 in fp32
and bf16 within the GPU tests' tolerances, and checkpoint save/resume continuing the run exactly."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.gpu.worker import TOLERANCE

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


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
    for name, case in result["levers"].items():
        precision = name.rsplit("/", 1)[1]
        assert case["loss_err"] < TOLERANCE[precision]["loss"], (name, case)
        assert precision == "bf16" or case["weights_err"] < TOLERANCE["fp32"]["weights"], (name, case)
    assert len(result["levers"]) == 5
    c = result["checkpoint"]
    assert c["first"] + c["rest"] == c["whole"] and c["weights_err"] == 0.0
