"""Throughput of the built-in GPT on one GPU: hybrid's engine at ZeRO stages 0-3 (every collective issued for
real on the one GPU), with and without activation checkpointing and with the optimizer offloaded, beside
FSDP2 ``fully_shard``, bf16 with gradients reduced in fp32 by both; tokens/s, model TFLOP/s, MFU, and the
allocator's peak against ``hybrid.plan.memory``'s prediction.

    python -m bench.gpu_bench --out bench/RESULTS-gpu.md [--tests "pytest summary"] [--cpu] [--jsonl FILE]
                              [--time-limit-s S] [--rows KEY,...]

The GPU run uses ``configs/gpt-1.3b.yaml`` (1.42B parameters, seq 2048); ``--cpu`` runs the same path on
the CPU with gpt-tiny in seconds (the CI's dry run). The rows, their step counts and their estimated cost
are ``bench.gpu_rows``'; each is measured by ``bench.gpu_measure`` in a child process, which appends it to
the JSONL file (default: ``--out`` with ``.jsonl``) as soon as it is measured; this process rewrites the
Markdown report after every row. So whatever stops the run -- a crash, a hang, the device time running out
-- every row measured before it is on disk. A row that fails is a row with its error: an exception, running
out of memory, a measuring process that crashed (a fresh one measures the rows left) or hung (killed after
``gpu_rows.row_timeout_s``), or the time limit reached before the row started. The exit status is 1 when
any row failed, 2 for no GPU (without ``--cpu``), else 0. Progress goes to stdout.

MFU = tokens/s x model FLOPs per token / the GPU's dense bf16 peak (``gpu_rows.PEAK_BF16``, by device
name; unknown GPUs and the CPU get tokens/s only). Model FLOPs per token are ``6·N + 12·L·h·s``, the same
with activation checkpointing (its recomputation is not model FLOPs).
"""

from __future__ import annotations

import argparse
import json
import platform
import signal
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Optional

from bench.gpu_rows import (MICRO_BATCH, PROCESS_START_S, REDUCE_DTYPE, RowSpec, flops_per_token, peak_bf16_flops,
                            row_estimate_s, row_timeout_s, rows)

ROOT = Path(__file__).resolve().parents[1]
GiB = 2**30
DEFAULT_TIME_LIMIT_S = 240.0
POLL_S = 0.5
TEARDOWN_S = 60.0  # a measuring process that wrote every row and has not exited after this is killed
EXIT_CONTEXT_SUSPECT = 3  # bench.gpu_measure: a row failed on CUDA and was written; a fresh process goes on

__all__ = ["flops_per_token", "peak_bf16_flops", "main"]


def log(message: str) -> None:
    print(f"[gpu-bench {time.strftime('%H:%M:%S')}] {message}", flush=True)


class RowFile:
    """The JSONL file the measuring processes append to, read as complete lines appear."""

    def __init__(self, path: Path):
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)  # --out may name a directory not made yet
        path.write_text("")
        self._offset, self._partial = 0, ""

    def new_rows(self) -> list[dict]:
        with open(self.path) as f:
            f.seek(self._offset)
            text = f.read()
            self._offset = f.tell()
        lines = (self._partial + text).split("\n")
        self._partial = lines.pop()
        return [json.loads(line) for line in lines if line.strip()]

    def append(self, row: dict) -> None:
        """A row this process writes itself, while no measuring process runs (a crash, a hang)."""
        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")
            self._offset, self._partial = f.tell(), ""


def failed_row(spec: RowSpec, error: str) -> dict:
    return {"row": spec.key, "label": spec.label, "impl": spec.impl, "stage": spec.stage,
            "checkpointing": spec.checkpointing, "offload": spec.offload, "error": error}


def measure_rows(specs: list[RowSpec], cpu: bool, rows_file: RowFile, deadline: float, timeout_s, on_row) -> None:
    """Every row of ``specs`` measured in child processes, ``on_row(row)`` as each arrives (see the module
    docstring for what becomes of a failure); ``timeout_s(spec)`` is how long a row may take."""
    kind = "cpu" if cpu else "cuda"
    pending, fruitless = list(specs), 0

    def fail(spec: RowSpec, error: str) -> None:
        row = failed_row(spec, error)
        rows_file.append(row)
        on_row(row)

    while pending:
        if time.time() > deadline:
            for spec in pending:
                fail(spec, "not run: the benchmark's time limit was reached before this row")
            return
        cmd = [sys.executable, "-m", "bench.gpu_measure", "--jsonl", str(rows_file.path),
               "--rows", ",".join(s.key for s in pending), "--deadline", str(deadline)] + (["--cpu"] if cpu else [])
        proc = subprocess.Popen(cmd, cwd=ROOT)
        measured, since, hung = 0, time.time(), False
        try:
            while True:
                exited = proc.poll() is not None
                for row in rows_file.new_rows():
                    pending.pop(0)
                    on_row(row)
                    measured, since = measured + 1, time.time()
                if exited:
                    break
                limit = timeout_s(pending[0]) + (0 if measured else PROCESS_START_S[kind]) if pending else TEARDOWN_S
                if time.time() - since > limit:
                    hung = bool(pending)
                    break
                time.sleep(POLL_S)
        finally:  # hung, or this process stopped (Stopped): the measuring process goes too
            if proc.poll() is None:
                _kill(proc)
        if not pending:
            return
        if hung:
            fail(pending.pop(0), f"timed out: no result after {limit:.0f} s (hung?); its process was killed")
            continue
        if proc.returncode in (0, EXIT_CONTEXT_SUSPECT):  # the deadline; or a failed row written, a fresh process
            continue
        fruitless = 0 if measured else fruitless + 1
        fail(pending.pop(0), f"the measuring process exited with status {_status(proc.returncode)} during this "
                             "row (its output is above)")
        if fruitless >= 2:
            for spec in list(pending):
                fail(spec, "not run: two measuring processes in a row failed before measuring anything")
            return


class Stopped(Exception):
    """This process got SIGTERM (``timeout`` in bench/gpu_check.sh): the rows not measured are reported so."""


def _stop(signum, frame) -> None:
    raise Stopped(signal.Signals(signum).name)


def _kill(proc: subprocess.Popen) -> None:
    proc.kill()
    proc.wait()


def _status(rc: int) -> str:
    return f"{rc} (signal {signal.Signals(-rc).name})" if rc < 0 else str(rc)


def machine(cpu: bool) -> dict:
    import torch

    facts = {"python": platform.python_version(), "torch": torch.__version__, "host cpu": platform.processor()
             or platform.machine()}
    if not cpu:
        facts.update(gpu=torch.cuda.get_device_name(0), gpus=torch.cuda.device_count(), cuda=torch.version.cuda,
                     gpu_memory_gib=round(torch.cuda.get_device_properties(0).total_memory / GiB, 1))
    else:
        facts["gpu"] = "none (--cpu dry run)"
    return facts


def model_facts(cpu: bool) -> dict:
    from bench.gpu_measure import MODEL
    from hybrid.models.gpt.model import GPTConfig, count_parameters

    kind = "cpu" if cpu else "cuda"
    cfg = GPTConfig.from_yaml(MODEL[kind])
    params = count_parameters(cfg)
    return {"cfg": cfg, "params": params, "micro_batch": MICRO_BATCH[kind],
            "flops_per_token": flops_per_token(params, cfg.n_layers, cfg.hidden, cfg.seq_len)}


def _gib(value: Optional[float]) -> str:
    return f"{value / GiB:.2f}" if value is not None else "n/a"


def report(rows_done: list[dict], facts: dict, model: dict, command: str, tests: str, prerequisites: str,
           timing: str) -> str:
    """The Markdown report: command, machine, model, one row per measurement (or its error), notes."""
    peak = peak_bf16_flops(facts.get("gpu", ""))
    cfg, per_token = model["cfg"], model["flops_per_token"]
    lines = ["# GPU check: tests/gpu and single-GPU throughput", "",
             f"Command: `{command}`  ", f"Date: {datetime.now(timezone.utc):%Y-%m-%d %H:%M UTC}  ",
             "Machine: " + ", ".join(f"{k} {v}" for k, v in facts.items()), "",
             f"tests/gpu: {tests or 'not run'}", ""]
    if prerequisites:
        lines += [f"Prerequisites: {prerequisites}", ""]
    lines += [f"Model: built-in GPT, {_count(model['params'])} parameters ({cfg.n_layers} layers, hidden "
              f"{cfg.hidden}, {cfg.n_heads} heads, vocab {cfg.vocab_size}), seq {cfg.seq_len}, micro-batch "
              f"{model['micro_batch']}, bf16, world 1; {per_token / 1e9:.2f} GFLOP per token (6N + 12·L·h·s). "
              f"Gradients are reduced in {REDUCE_DTYPE} by both (hybrid `zero.reduce_dtype: {REDUCE_DTYPE}`, FSDP2 "
              f"`MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype={REDUCE_DTYPE})`); hybrid issues every "
              "collective a multi-GPU job issues on the one device (`HYBRID_FORCE_COLLECTIVES=1`).", "",
              "| implementation | activation checkpointing | tokens/s | step (ms) | model TFLOP/s | MFU "
              "| peak memory (GiB) | predicted peak (GiB) | collectives/step |",
              "|---|---|---|---|---|---|---|---|---|"]
    for r in rows_done:
        ac = "on" if r["checkpointing"] else "off"
        if "error" in r:
            lines.append(f"| {r['label']} | {ac} | failed: {r['error']} | | | | | | |")
            continue
        tflops = r["tokens_per_s"] * per_token / 1e12
        mfu = f"{100 * r['tokens_per_s'] * per_token / peak:.1f}%" if peak else "n/a"
        calls = f"{r['collectives_per_step']:.0f}" if "collectives_per_step" in r else "n/a"
        lines.append(f"| {r['label']} | {ac} | {r['tokens_per_s']:,.0f} | {r['step_s'] * 1e3:.1f} | {tflops:.2f} "
                     f"| {mfu} | {_gib(r.get('peak_bytes'))} | {_gib(r.get('predicted_peak_bytes'))} | {calls} |")
    failed = sum("error" in r for r in rows_done)
    lines += ["", f"MFU against the dense bf16 peak of {peak / 1e12:.0f} TFLOP/s." if peak else
              "MFU needs the GPU's bf16 peak, which is not known for this device: tokens/s only.",
              "Peak memory: `torch.cuda.max_memory_allocated` over the timed steps; predicted: "
              "`hybrid.plan.memory.predict_memory` for the same config (its allocator peak).",
              f"Rows: {len(rows_done)} written, {failed} with an error. {timing}", ""]
    return "\n".join(lines)


def _count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M" if n >= 1e6 else f"{n:,}"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="Single-GPU throughput of hybrid ZeRO 0-3 beside FSDP2.")
    parser.add_argument("--out", required=True, help="where to write the Markdown report")
    parser.add_argument("--cpu", action="store_true", help="dry run on the CPU with gpt-tiny")
    parser.add_argument("--tests", default="", help="the tests/gpu summary line to put in the report")
    parser.add_argument("--command", default="bash bench/gpu_check.sh", help="the command to put in the report")
    parser.add_argument("--prerequisites", default="", help="what the check found missing, for the report")
    parser.add_argument("--jsonl", default=None, help="the rows as measured (default: OUT with .jsonl)")
    parser.add_argument("--time-limit-s", type=float, default=DEFAULT_TIME_LIMIT_S,
                        help="start no row after this many seconds")
    parser.add_argument("--rows", default=None, help="only these rows (comma-separated keys: hybrid-0, fsdp2-ac, ...)")
    args = parser.parse_args(argv)
    import torch

    if not args.cpu and not torch.cuda.is_available():
        print("error: no CUDA GPU is visible (torch.cuda.is_available() is False); run with --cpu for the dry "
              "run, or on a machine with a GPU.", file=sys.stderr)
        return 2
    kind = "cpu" if args.cpu else "cuda"
    specs = rows(kind)
    if args.rows:
        wanted = args.rows.split(",")
        unknown = sorted(set(wanted) - {s.key for s in specs})
        if unknown:
            print(f"error: unknown row(s) {', '.join(unknown)}; the rows are {', '.join(s.key for s in specs)}",
                  file=sys.stderr)
            return 2
        specs = [s for s in specs if s.key in wanted]
    out = Path(args.out)
    rows_file = RowFile(Path(args.jsonl) if args.jsonl else out.with_suffix(".jsonl"))
    facts, model = machine(args.cpu), model_facts(args.cpu)
    step_flops = model["flops_per_token"] * model["micro_batch"] * model["cfg"].seq_len
    peak = peak_bf16_flops(facts.get("gpu", ""))
    estimate = PROCESS_START_S[kind] + sum(row_estimate_s(s, kind, step_flops, peak) for s in specs)
    log(f"{len(specs)} rows on {facts['gpu']}: estimated {estimate:.0f} s, at most {args.time_limit_s:.0f} s "
        f"before the last row starts; rows as measured in {rows_file.path}")
    started = time.time()
    done: list[dict] = []

    def on_row(row: dict) -> None:
        done.append(row)
        timing = f"Benchmark time {time.time() - started:.0f} s so far (estimated {estimate:.0f} s)."
        out.write_text(report(done, facts, model, args.command, args.tests, args.prerequisites, timing))
        state = f"error: {row['error'][:160]}" if "error" in row else "ok"
        log(f"row {len(done)}/{len(specs)} {row['row']}: {state}; report written to {out}")

    signal.signal(signal.SIGTERM, _stop)
    try:
        measure_rows(specs, args.cpu, rows_file, started + args.time_limit_s,
                     lambda spec: row_timeout_s(row_estimate_s(spec, kind, step_flops, peak)), on_row)
    except Stopped as stop:
        for spec in specs[len(done):]:
            row = failed_row(spec, f"not measured: the benchmark was stopped ({stop}) after "
                                   f"{time.time() - started:.0f} s")
            rows_file.append(row)
            on_row(row)
    failed = [r["row"] for r in done if "error" in r]
    log(f"done in {time.time() - started:.0f} s (estimated {estimate:.0f} s): {len(done)} rows, "
        + (f"errors in {', '.join(failed)}" if failed else "no errors") + f"; report {out}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
