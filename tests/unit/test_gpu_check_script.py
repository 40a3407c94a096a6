"""``bash bench/gpu_check.sh --cpu``: the GPU check's dry run goes through the same script path on this CPU
(tests/gpu collected and skipped, the benchmark on gpt-tiny) and writes its report where it is told, never
over the committed bench/RESULTS-gpu.md. Also: the MFU arithmetic, and that nothing the GPU machine runs
imports Ray (that machine has none)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench.gpu_bench import flops_per_token, peak_bf16_flops

ROOT = Path(__file__).resolve().parents[2]
COMMITTED = ROOT / "bench" / "RESULTS-gpu.md"


def test_peak_lookup_by_device_name_and_model_flops_per_token():
    assert peak_bf16_flops("NVIDIA H200") == peak_bf16_flops("NVIDIA H100 80GB HBM3") == 989e12
    assert peak_bf16_flops("NVIDIA A100-SXM4-80GB") == 312e12
    assert peak_bf16_flops("NVIDIA GeForce RTX 4090") is None
    assert flops_per_token(params=1000, layers=2, hidden=8, seq_len=16) == 6 * 1000 + 12 * 2 * 8 * 16


@pytest.mark.slow  # a process importing everything the GPU machine runs: not in the fast tier
def test_nothing_the_gpu_machine_runs_imports_ray():
    code = ("import sys, hybrid, hybrid.models.gpt, hybrid.runtime.train, hybrid.comm.mesh, hybrid.runtime.local_launch, "
            "hybrid.plan.monitor, bench.gpu_bench, tests.gpu.worker, tests.gpu.torchrun, launch.cli; "
            "launch.cli._register(); print('ray' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"


@pytest.mark.slow
def test_the_gpu_check_dry_run_passes_and_writes_its_report_where_told(tmp_path):
    before = COMMITTED.read_bytes() if COMMITTED.exists() else None
    out = tmp_path / "RESULTS-gpu.md"
    done = subprocess.run(["bash", "bench/gpu_check.sh", "--cpu", "--out", str(out)], cwd=ROOT,
                          env={**os.environ, "PYTHON": sys.executable}, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert "step 1/2: tests/gpu" in done.stdout and "step 2/2: throughput benchmark" in done.stdout
    assert " skipped" in done.stdout and " failed" not in done.stdout  # collected cleanly, skipped without CUDA
    report = out.read_text()
    assert "Command: `bash bench/gpu_check.sh --cpu`" in report and "tests/gpu: " in report
    for row in ("| hybrid ZeRO-0 | off |", "| FSDP2 fully_shard | off |"):
        assert row in report
    assert "out of memory" not in report and "tokens/s only" in report
    assert (COMMITTED.read_bytes() if COMMITTED.exists() else None) == before


def test_a_bad_argument_is_exit_status_2():
    done = subprocess.run(["bash", "bench/gpu_check.sh", "--gpu"], cwd=ROOT, capture_output=True, text=True,
                          timeout=30)
    assert done.returncode == 2 and "unknown argument '--gpu'" in done.stderr
