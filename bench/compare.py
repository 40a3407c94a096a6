"""Benchmark hybrid against DDP, ZeroRedundancyOptimizer, FSDP2, DeepSpeed and the compute floor, side by side.

    python bench/compare.py            # full comparison (make bench): 3 workloads, fp32 and bf16, 2 passes
    python bench/compare.py --quick    # tiny model, 3 steps, a few implementations, 1 pass (the test runs this)
    python bench/compare.py --world 4  # every row but the floor on 4 ranks (default 2)

Each implementation x ZeRO stage trains the same GPT (same seed, same batches) in its own freshly spawned
world of ``--world`` ranks (default 2; gloo on CPU, one thread per rank); the compute floor runs rank 0's share of the work in a
world of one (``bench.peers``). With ``--passes N`` every row (implementation x stage x workload x precision)
runs N times, interleaved: pass 1 of every row, then pass 2, ...; a row reports the lower median of its
passes' step times (with 2: the faster) and the spread between them (``report.combine_passes``). The run
fails (exit 1) when the implementations' losses disagree beyond the precision's tolerance in any pass, when
a run fails, or when hybrid's traffic per step is off the seed's ratios. The full run writes the tables to
bench/RESULTS.md, keeping anything below the ``<!-- notes -->`` marker of the previous file.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import shlex
import sys
import time
from importlib import metadata
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import report  # noqa: E402
from bench.peers import FLOOR, LABELS, STAGES, deepspeed_available, math_note, world_size  # noqa: E402
from bench.workload import Workload, count_parameters, workloads  # noqa: E402

NOTES_MARKER = "<!-- notes -->"
QUICK_RUNS = [("hybrid", 0), ("hybrid", 3), ("ddp", 0), ("fsdp2", 3), ("deepspeed", 3), (FLOOR, 0)]


def plan(quick: bool, only: list[str] | None, with_deepspeed: bool) -> list[tuple[str, int]]:
    runs = QUICK_RUNS if quick else [(impl, s) for impl, stages in STAGES.items() for s in stages]
    if only:
        wanted = set(only)
        runs = [(i, s) for i, s in runs if i in wanted or f"{i}:{s}" in wanted]
    if not with_deepspeed:
        runs = [(i, s) for i, s in runs if i != "deepspeed"]
    return runs


def run_one(impl: str, stage: int, w: Workload, timeout_s: float, profile_dir: str | None = None,
            tag: str = "") -> report.Row:
    """One fresh run of ``impl:stage`` on ``w`` (its profile, if any, written as ``...{tag}.txt``)."""
    from bench.measure import run_rank
    from hybrid.runtime.local_launch import LocalRunError, run_local

    t0 = time.perf_counter()
    try:
        per_rank = run_local(run_rank, world_size(impl, w), impl, stage, w, bool(profile_dir),
                             timeout_s=timeout_s, threads=1)
    except LocalRunError as exc:
        print(f"  {impl}:{stage} FAILED\n{exc}", file=sys.stderr, flush=True)
        last = [line for line in str(exc).strip().splitlines() if line.strip()][-1]
        return report.Row(impl, stage, w.name, w.precision, error=last[:160])
    if profile_dir:
        path = Path(profile_dir) / f"{w.name}-{w.precision}-{impl}-{stage}{tag}.txt"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("\n\n".join(f"rank {r['rank']}\n{r['profile']}" for r in per_rank))
    row = report.summarize(impl, stage, w.name, w.precision, per_rank, time.perf_counter() - t0)
    row.math_note = math_note(impl, stage, w.precision, w.world_size)
    return row


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / (1 << 30)
    return (f"{os.cpu_count()} cores ({cpu}), {mem:.0f} GiB RAM, {platform.system()} {platform.release()}, "
            f"Python {platform.python_version()}, torch {_version('torch')}, deepspeed {_version('deepspeed')}")


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "not installed"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="tiny model, 3 steps, a subset of implementations")
    ap.add_argument("--sizes", nargs="*", help="workload names to run (default: all)")
    ap.add_argument("--precisions", nargs="*", help="fp32 and/or bf16 (default: both; --quick: fp32)")
    ap.add_argument("--only", nargs="*", help="implementations or impl:stage to run, e.g. hybrid ddp fsdp2:3 floor")
    ap.add_argument("--passes", type=int, help="runs of every row, interleaved (default 2; --quick: 1)")
    ap.add_argument("--out", help="Markdown file to write (default: bench/RESULTS.md; --quick: none)")
    ap.add_argument("--json", metavar="PATH", help="also write every row (per-step losses included) as JSON")
    ap.add_argument("--profile", metavar="DIR", help="run the timed steps under torch.profiler (slower; the "
                    "times are then not comparable) and write each run's op table to DIR")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds allowed per implementation run")
    ap.add_argument("--world", type=int, default=Workload.world_size,
                    help=f"ranks of every row but the floor (default {Workload.world_size})")
    args = ap.parse_args(argv)
    passes = args.passes or (1 if args.quick else 2)
    if passes < 1:
        ap.error("--passes must be >= 1")
    if args.world < 2:
        ap.error("--world must be >= 2 (the floor row is the one-process comparison)")

    os.environ["OMP_NUM_THREADS"] = "1"  # inherited by every spawned rank
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ["MASTER_ADDR"] = "127.0.0.1"

    precisions = args.precisions or (["fp32"] if args.quick else ["fp32", "bf16"])
    cases = [base.with_precision(p).with_world(args.world) for base in workloads(args.quick)
             if not args.sizes or base.name in args.sizes for p in precisions]
    with_ds = deepspeed_available()
    if not with_ds:
        print("deepspeed is not importable: DeepSpeed rows skipped (install the bench extra: "
              "DS_BUILD_OPS=0 pip install -e '.[bench]')", flush=True)
    runs = plan(args.quick, args.only, with_ds)
    command = " ".join(shlex.quote(a) for a in ["python", "bench/compare.py", *(argv or sys.argv[1:])])

    started = time.perf_counter()
    by_pass = run_passes(cases, runs, passes, args.timeout, args.profile, started)
    sections, failures = [], []
    for w, pass_rows in zip(cases, by_pass):
        rows = [report.combine_passes(list(same)) for same in zip(*pass_rows)]
        failures += [f"{w.name} {w.precision} {r.key}: {r.error}" for r in rows if r.error]
        tol = report.LOSS_TOLERANCE[w.precision]
        bad = [f"pass {k + 1}: {b}" for k, one_pass in enumerate(pass_rows)
               for b in report.loss_disagreements(one_pass, tol)]
        failures += [f"{w.name} {w.precision} losses disagree: {b}" for b in bad]
        ratios = report.traffic_ratios(rows)
        failures += [f"{w.name} {w.precision} traffic: {m}" for m in report.traffic_mismatches(ratios)]
        sections.append((w, rows, bad))

    if args.json:
        Path(args.json).write_text(json.dumps([dataclasses.asdict(r) for _, rows, _ in sections for r in rows],
                                              indent=1))
    text = render(sections, command, time.perf_counter() - started, passes, args.world)
    print("\n" + text)
    out = args.out or (None if args.quick else str(Path(__file__).with_name("RESULTS.md")))
    if out and not any(bad for _, _, bad in sections):
        write_keeping_notes(Path(out), text)
        print(f"\nwrote {out}")
    if failures:
        print("\nFAILED:\n  " + "\n  ".join(failures), file=sys.stderr)
        return 1
    return 0


def run_passes(cases: list[Workload], runs: list[tuple[str, int]], passes: int, timeout_s: float,
               profile_dir: str | None, started: float) -> list[list[list[report.Row]]]:
    """Run every (case, run) ``passes`` times, pass after pass; ``[case][pass][run] -> Row``. After each
    pass, print how long the whole benchmark will take at that pace."""
    by_pass: list[list[list[report.Row]]] = [[] for _ in cases]
    for k in range(passes):
        for w, pass_rows in zip(cases, by_pass):
            print(f"== pass {k + 1}/{passes}: {w.name} params ({count_parameters(w):,}), {w.precision}, "
                  f"world size {w.world_size}", flush=True)
            tag = f"-pass{k + 1}" if passes > 1 else ""
            pass_rows.append([_run_and_print(impl, stage, w, timeout_s, profile_dir, tag) for impl, stage in runs])
        elapsed = time.perf_counter() - started
        print(f"== pass {k + 1}/{passes} done: {elapsed / 60:.1f} min so far, about "
              f"{elapsed / (k + 1) * passes / 60:.1f} min in all", flush=True)
    return by_pass


def _run_and_print(impl: str, stage: int, w: Workload, timeout_s: float, profile_dir: str | None,
                   tag: str) -> report.Row:
    """``run_one`` plus its progress line."""
    row = run_one(impl, stage, w, timeout_s, profile_dir, tag)
    if not row.error:
        print(f"  {row.key:12s} {row.step_s * 1e3:9.1f} ms/step  RSS growth "
              f"{row.delta_rss / report.MiB:7.0f} MiB  loss {row.losses[-1]:.5f}  ({row.wall_s:.0f} s)",
              flush=True)
    return row


def render(sections, command: str, elapsed_s: float, passes: int, world: int) -> str:
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    parts = [
        "# Benchmark: hybrid vs DDP, ZeroRedundancyOptimizer, FSDP2, DeepSpeed and the compute floor",
        "",
        f"- Command: `DS_ACCELERATOR=cpu {command}` (what `make bench` runs), {elapsed_s / 60:.1f} min in all",
        f"- Machine: {machine()}",
        f"- Date: {now}",
        f"- Every row but the floor: world size {world} on one machine, gloo, 1 thread per rank (OMP_NUM_THREADS=1), "
        "its own fresh processes; the same GPT, seed and batches; AdamW with the same hyper-parameters.",
        "- compute floor: the same per-rank work in one process (world size 1, no collective in its step): "
        "rank 0's rows of each batch, the model in the workload precision as hybrid computes it (fp32: fp32 "
        "parameters; bf16: bf16 parameters and gradients, an fp32 master), fused AdamW. Its losses are those "
        f"of 1/{world} of the batch (left out of the loss check); the summary compares every hybrid stage with it.",
        "- step time: median over the timed steps of the slowest rank (forward + backward + optimizer step, "
        "a barrier before and after each step). vs hybrid: this row's time / hybrid's at the same stage "
        "(> 1 means hybrid is faster).",
        f"- passes: {passes}; every row runs once per pass, interleaved (pass 1 of all rows, then pass 2, ...). "
        "The step time of a row is the lower median of its passes' step times"
        + (" -- with 2 passes, the faster of the two" if passes == 2 else "")
        + "; pass spread: (slowest - fastest) / fastest pass. Peak RSS, RSS growth and model states: the "
        "largest over passes.",
        "- peak RSS: the rank's lifetime peak (largest rank). RSS growth: peak minus the RSS just before the "
        "model was built (after the implementation's imports) -- the training footprint; the memory ratio "
        "below uses it.",
        "- model states: parameter, gradient and optimizer-state tensors held per rank, read between backward "
        "and optimizer step (hybrid: `engine.memory_report()`; peers: the distinct storages reachable from the "
        "module and the optimizer, communication buckets excluded).",
        "- traffic: hybrid's `engine.comm_report()` per timed step (logical bytes: all-reduce 2|X|, "
        "reduce-scatter and all-gather |X|); the peers issue their collectives from C++ and are not counted.",
        "- bf16: hybrid and DeepSpeed keep bf16 parameters and gradients with fp32 masters; FSDP2 uses "
        "MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=bf16) over fp32 shards; DDP and "
        "ZeroRedundancyOptimizer keep fp32 state and run the forward under torch.autocast(bfloat16).",
        "",
    ]
    for w, rows, bad in sections:
        n_params = count_parameters(w)
        parts += [f"## {w.name} ({n_params / 1e6:.1f}M parameters), {w.precision}", "",
                  f"GPT {w.model}, micro batch {w.micro_batch} per rank, {w.warmup} warm-up + {w.steps} timed "
                  f"steps. Largest loss spread between implementations over all steps: "
                  f"{report.max_loss_spread(rows):.2e} (tolerance {report.LOSS_TOLERANCE[w.precision]:g}).", ""]
        if bad:
            parts += ["**LOSSES DISAGREE -- the times below are not comparable:**", ""]
            parts += [f"- {b}" for b in bad] + [""]
        parts += [report.render_rows(rows, LABELS), ""]
        parts += [f"(*) {r.key}: {r.math_note}." for r in rows if r.math_note and not r.error]
        parts += [""] if any(r.math_note for r in rows) else []
        summary = report.stage_summary(rows)
        if summary:
            parts += [report.render_summary(summary), ""]
        parts += [report.render_traffic(report.traffic_ratios(rows)), ""]
    return "\n".join(parts)


def write_keeping_notes(path: Path, text: str) -> None:
    notes = ""
    if path.exists():
        old = path.read_text()
        if NOTES_MARKER in old:
            notes = old[old.index(NOTES_MARKER):]
    path.write_text(text + ("\n" + notes if notes else ""))


if __name__ == "__main__":
    sys.exit(main())
