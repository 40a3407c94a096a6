"""The single-GPU benchmark cannot lose its report: a row that fails (here a real ``ConfigError`` from a bad
``HYBRID_FORCE_COLLECTIVES``, which only hybrid's rows read) is a row with its error, the rows after it are
still measured and written (JSONL as measured, then the Markdown), and the exit status is 1; rows the time
limit leaves unstarted are reported as such. The rows it measures fit the GPU check's time budget, estimated
from the model's FLOPs."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench.gpu_bench import DEFAULT_TIME_LIMIT_S
from bench.gpu_measure import MODEL
from bench.gpu_rows import (MICRO_BATCH, PROCESS_START_S, flops_per_token, peak_bf16_flops, row_estimate_s,
                            row_timeout_s, rows)
from hybrid.models.gpt.model import GPTConfig, count_parameters

ROOT = Path(__file__).resolve().parents[2]


def _bench(tmp_path, *args, env=None):
    out = tmp_path / "report.md"
    done = subprocess.run([sys.executable, "-m", "bench.gpu_bench", "--cpu", "--out", str(out), *args], cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}, capture_output=True,
                          text=True, timeout=240)
    rows_written = [json.loads(line) for line in out.with_suffix(".jsonl").read_text().splitlines()]
    return done, rows_written, out.read_text()


@pytest.mark.slow
def test_a_row_that_raises_is_reported_and_the_rows_after_it_are_still_measured(tmp_path):
    done, written, report = _bench(tmp_path, "--rows", "hybrid-0,fsdp2", env={"HYBRID_FORCE_COLLECTIVES": "bogus"})
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-3000:]
    assert [r["row"] for r in written] == ["hybrid-0", "fsdp2"]
    failed, measured = written
    assert failed["error"].startswith("ConfigError: HYBRID_FORCE_COLLECTIVES is 'bogus'") and "oom" not in failed
    assert "Traceback" in failed["traceback"]
    assert "error" not in measured and measured["tokens_per_s"] > 0
    assert "| hybrid ZeRO-0 | off | failed: ConfigError: HYBRID_FORCE_COLLECTIVES is 'bogus'" in report
    assert "| FSDP2 fully_shard | off | " in report and "Rows: 2 written, 1 with an error." in report
    assert "row 1/2 hybrid-0: error: ConfigError" in done.stdout and "errors in hybrid-0" in done.stdout


@pytest.mark.slow
def test_rows_the_time_limit_leaves_unstarted_are_reported_and_fail_the_run(tmp_path):
    done, written, report = _bench(tmp_path, "--rows", "hybrid-3,fsdp2-ac", "--time-limit-s", "0")
    assert done.returncode == 1
    assert [(r["row"], r["error"]) for r in written] == [
        (key, "not run: the benchmark's time limit was reached before this row") for key in ("hybrid-3", "fsdp2-ac")]
    assert "| hybrid ZeRO-3 | off | failed: not run" in report
    assert "| FSDP2 fully_shard | on | failed: not run" in report


def test_an_unknown_row_is_refused_in_one_sentence(tmp_path):
    done = subprocess.run([sys.executable, "-m", "bench.gpu_bench", "--cpu", "--out", str(tmp_path / "r.md"),
                           "--rows", "hybrid-4"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "unknown row(s) hybrid-4; the rows are hybrid-0, " in done.stderr


def test_the_rows_cover_every_stage_with_and_without_checkpointing_offload_and_fsdp2():
    keys = [spec.key for spec in rows("cuda")]
    assert keys[:5] == ["hybrid-0", "hybrid-1", "hybrid-2", "hybrid-3", "fsdp2"]  # what the report needs most first
    assert set(keys) == {f"hybrid-{s}" for s in range(4)} | {f"hybrid-{s}-ac" for s in range(4)} | {
        "fsdp2", "fsdp2-ac", "hybrid-3-offload"}


def test_the_gpu_rows_fit_the_time_budget_estimated_from_flops():
    cfg = GPTConfig.from_yaml(MODEL["cuda"])
    per_token = flops_per_token(count_parameters(cfg), cfg.n_layers, cfg.hidden, cfg.seq_len)
    assert 9e9 < per_token < 1.1e10  # the ~1.4B GPT at seq 2048
    step_flops = per_token * MICRO_BATCH["cuda"] * cfg.seq_len
    estimates = [row_estimate_s(spec, "cuda", step_flops, peak_bf16_flops("NVIDIA H200")) for spec in rows("cuda")]
    total = PROCESS_START_S["cuda"] + sum(estimates)
    assert total < 0.75 * DEFAULT_TIME_LIMIT_S, total  # room for a slower GPU or start-up than assumed
    assert all(row_timeout_s(e) >= 2 * e for e in estimates)
