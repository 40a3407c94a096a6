"""``bash bench/gpu_check.sh --cpu``: the GPU check's dry run goes through the same script path on this CPU
(tests/gpu collected and skipped, the benchmark on gpt-tiny) and writes its report where it is told, never
over the committed bench/RESULTS-gpu.md; the report's structure and figures (every tests/gpu test skipped, the
model line, one consistent row per implementation); the report of a GPU run from known figures. Also: the MFU arithmetic, and that nothing the GPU machine runs
imports Ray (that machine has none)."""

import os
import re
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


TABLE_HEADER = ("| implementation | activation checkpointing | tokens/s | step (ms) | model TFLOP/s | MFU "
                "| peak memory (GiB) | predicted peak (GiB) | collectives/step |")


def _table(report: str) -> list:
    """The rows of the report's results table, as lists of cells."""
    lines = report.splitlines()
    start = lines.index(TABLE_HEADER) + 2  # header, separator
    rows = []
    for line in lines[start:]:
        if not line.startswith("| "):
            break
        rows.append([c.strip() for c in line.strip().strip("|").split("|")])
    return rows


@pytest.mark.slow
def test_the_gpu_check_dry_run_passes_and_writes_its_report_where_told(tmp_path):
    before = COMMITTED.read_bytes() if COMMITTED.exists() else None
    out = tmp_path / "RESULTS-gpu.md"
    done = subprocess.run(["bash", "bench/gpu_check.sh", "--cpu", "--out", str(out)], cwd=ROOT,
                          env={**os.environ, "PYTHON": sys.executable}, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert "step 1/2: tests/gpu" in done.stdout and "step 2/2: throughput benchmark" in done.stdout
    assert (COMMITTED.read_bytes() if COMMITTED.exists() else None) == before

    report = out.read_text()
    lines = report.splitlines()
    assert lines[0] == "# GPU check: tests/gpu and single-GPU throughput"
    assert "Command: `bash bench/gpu_check.sh --cpu`  " in lines and "gpu none (--cpu dry run)" in report
    # tests/gpu collected cleanly and skipped without CUDA: every test skipped, as many as pytest listed
    summary = next(line for line in lines if line.startswith("tests/gpu: "))
    skipped = re.fullmatch(r"tests/gpu: (\d+) skipped in [0-9.]+s \(exit 0\)", summary)
    assert skipped, summary
    listed = sum(int(n) for n in re.findall(r"^SKIPPED \[(\d+)\] tests/gpu/", done.stdout, re.M))
    assert int(skipped.group(1)) == listed > 0, (summary, listed)
    # the model line: gpt-tiny's shape, its parameter count, the dry run's micro-batch
    assert (f"Model: built-in GPT, 134,912 parameters (2 layers, hidden 64, 4 heads, vocab 256), seq 32, "
            f"micro-batch 2, bf16, world 1; {flops_per_token(134_912, 2, 64, 32) / 1e9:.2f} GFLOP per token") in report
    # one row per benchmark row (bench.gpu_rows.rows), each a run of the same steps: tokens/s x the step time =
    # the micro-batch's tokens (2 x 32), to the rounding of the two figures; hybrid's rows issue collectives
    # even on one device (forced), FSDP2's are not counted
    from bench.gpu_rows import rows as bench_rows

    rows = _table(report)
    specs = bench_rows("cpu")
    assert [r[:2] for r in rows] == [[s.label, "on" if s.checkpointing else "off"] for s in specs], rows
    for spec, (name, _, tokens_per_s, step_ms, tflops, mfu, memory, predicted, calls) in zip(specs, rows):
        tokens = float(tokens_per_s.replace(",", "")) * float(step_ms) / 1000
        assert tokens == pytest.approx(2 * 32, rel=0.03), (name, tokens_per_s, step_ms)
        assert (mfu, memory) == ("n/a", "n/a")  # the CPU: no bf16 peak, no CUDA allocator
        assert (int(calls) > 0) if spec.impl == "hybrid" else calls == "n/a", (name, calls)
    assert "MFU needs the GPU's bf16 peak, which is not known for this device: tokens/s only." in lines
    assert f"Rows: {len(specs)} written, 0 with an error." in report


def test_the_report_of_a_gpu_run():
    """``report`` for an H200 run, from rows whose figures are known: model TFLOP/s = tokens/s x model FLOPs per
    token, MFU = that / the dense bf16 peak, peak and predicted memory in GiB, a failed row as such."""
    from bench.gpu_bench import report
    from hybrid.models.gpt.model import GPTConfig

    cfg = GPTConfig.from_yaml(ROOT / "configs" / "gpt-tiny.yaml")
    per_token = 6 * 134_912 + 12 * 2 * 64 * 32
    model = {"cfg": cfg, "params": 134_912, "micro_batch": 4, "flops_per_token": per_token}
    rows = [{"label": "hybrid ZeRO-0", "checkpointing": False, "tokens_per_s": 1e9, "step_s": 0.25,
             "peak_bytes": 3 * 2**30, "predicted_peak_bytes": 2.5 * 2**30, "collectives_per_step": 7},
            {"label": "FSDP2 fully_shard", "checkpointing": True, "error": "out of memory: CUDA out of memory"}]
    text = report(rows, {"gpu": "NVIDIA H200", "gpus": 1}, model, "bash bench/gpu_check.sh", "16 passed", "", "")
    assert _table(text) == [
        ["hybrid ZeRO-0", "off", "1,000,000,000", "250.0", f"{1e9 * per_token / 1e12:.2f}",
         f"{100 * 1e9 * per_token / 989e12:.1f}%", "3.00", "2.50", "7"],
        ["FSDP2 fully_shard", "on", "failed: out of memory: CUDA out of memory", "", "", "", "", "", ""]]
    assert "tests/gpu: 16 passed" in text and "MFU against the dense bf16 peak of 989 TFLOP/s." in text
    assert "Rows: 2 written, 1 with an error." in text


def test_a_bad_argument_is_exit_status_2():
    done = subprocess.run(["bash", "bench/gpu_check.sh", "--gpu"], cwd=ROOT, capture_output=True, text=True,
                          timeout=30)
    assert done.returncode == 2 and "unknown argument '--gpu'" in done.stderr
