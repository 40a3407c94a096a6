"""int8 ZeRO collectives against exact ones: the built-in GPT on the demo corpus, 300 steps each (issue 37).

    python bench/quantized.py              # 2 simulated nodes x 2 ranks, stage 3, 300 steps per run
    python bench/quantized.py --steps 20   # checks the script, proves nothing (RESULTS.md left alone)

Prepares the demo corpus where ``make demo`` does (``runs/demo-corpus/corpus.bin``, ``hybrid data prepare``) when
it is missing, then trains ``configs/gpt-tiny-text.yaml``'s GPT on it with the real entrypoint
(``hybrid.models.gpt:train`` through a ``Context``, as a launched rank runs it, the ``zero:`` options in its
model config) on 4 gloo ranks placed on 2 simulated nodes of 2, fp32, ZeRO stage 3, the same seed and batches:

* ``exact``: two-level collectives and hpZ's secondary shard (``hierarchical: true, secondary_shard: node``);
* ``int8``: the same with ``quantized_weights: int8`` and ``quantized_gradients: int8`` (ZeRO++'s qwZ and qgZ).

Every number comes from the ranks' step reports (what ``metrics.jsonl`` carries): the loss (``job_loss``, the DP
mean), the bytes across nodes per step (``dp_inter_bytes``, rank 0's) and the int8 error (``quant_error_*``).
Pass: the final loss (mean of the last 10 steps, as the run summary states it) of ``int8`` within 2 % of
``exact``'s (exit 1 otherwise). Without ``--steps`` the section below in bench/RESULTS.md is replaced.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

SECTION = "## Quantized ZeRO collectives: the loss curve (issue 37)"
CORPUS = ROOT / "runs" / "demo-corpus" / "corpus.bin"
CONFIG = ROOT / "configs" / "gpt-tiny-text.yaml"
# param_persistence_threshold 0: every unit of this small model is gathered (the default keeps most of it whole)
RUNS = {"exact": {"hierarchical": True, "secondary_shard": "node", "param_persistence_threshold": 0},
        "int8": {"hierarchical": True, "secondary_shard": "node", "param_persistence_threshold": 0,
                 "quantized_weights": "int8", "quantized_gradients": "int8"}}
WORLD, PER_NODE, MICRO_BATCH, STAGE = 4, 2, 8, 3
FINAL = 10      # the final loss: the mean of this many last steps (launch.job.metrics.FINAL_STEPS)
EVERY = 25      # the curve: the mean loss of each window of this many steps
TOLERANCE = 0.02


def prepare_corpus() -> None:
    """The demo corpus, as ``make demo`` prepares it, where it is missing."""
    if CORPUS.exists():
        return
    sources = ["README.md"] + sorted(str(p.relative_to(ROOT)) for pattern in
                                     ("hybrid/*.py", "hybrid/*/*.py", "hybrid/*/*/*.py", "launch/*.py", "launch/*/*.py")
                                     for p in ROOT.glob(pattern))
    subprocess.run([sys.executable, "-m", "launch.cli", "data", "prepare", *sources, "--out", str(CORPUS)],
                   cwd=ROOT, check=True)


def _rank(steps: int) -> dict:
    """One rank: every run in turn on 2 simulated nodes; its step reports per run."""
    import torch.distributed as dist
    import yaml

    from hybrid.comm.mesh import build_mesh
    from hybrid.models.gpt import train
    from hybrid.runtime.train import Context, JobSettings

    r = dist.get_rank()
    os.environ.update(LOCAL_RANK=str(r % PER_NODE), LOCAL_WORLD_SIZE=str(PER_NODE),
                      GROUP_RANK=str(r // PER_NODE), NODE_RANK=str(r // PER_NODE))
    mesh = build_mesh(tp=1)
    model = yaml.safe_load(CONFIG.read_text())["model"]
    out = {}
    for name, zero in RUNS.items():
        reports: list = []
        settings = JobSettings(steps=steps, micro_batch=MICRO_BATCH, stage=STAGE, precision="fp32", seed=0,
                               measure_every=10 ** 9)
        config = {"model": model, "data": str(CORPUS), "zero": zero}
        ctx = Context(mesh, config, settings, model_config_path=str(CONFIG), rank=r, world_size=WORLD,
                      reporter=reports.append)
        started = time.perf_counter()
        train(ctx)
        out[name] = {"reports": [x for x in reports if "loss" in x], "seconds": time.perf_counter() - started}
    return out


def _mean(values: list) -> float:
    return sum(values) / len(values)


def summarize(rank0: dict) -> dict:
    """Per run: the loss curve (window means), the final loss, bytes across nodes per step, the int8 errors."""
    out = {}
    for name, run in rank0.items():
        steps = run["reports"]
        losses = [s["job_loss"] for s in steps]
        later = steps[3:] or steps  # the first steps may gather what later ones keep
        inter = sorted(s["dp_inter_bytes"] for s in later)[len(later) // 2]
        errors = {kind: _mean([s[f"quant_error_{kind}"] for s in steps if f"quant_error_{kind}" in s] or [0.0])
                  for kind in ("weights", "gradients")}
        out[name] = {"curve": [_mean(losses[i:i + EVERY]) for i in range(0, len(losses), EVERY)],
                     "final": _mean(losses[-FINAL:]), "first": losses[0], "inter": inter, "errors": errors,
                     "seconds": run["seconds"], "steps": len(losses)}
    return out


def report(res: dict, steps: int, command: str, minutes: float) -> list[str]:
    exact, int8 = res["exact"]["final"], res["int8"]["final"]
    gap = (int8 - exact) / exact
    lines = [SECTION, "",
             f"- Command: `{command}` ({minutes:.1f} min in all)",
             f"- Machine: {os.cpu_count()} cores, Python {platform.python_version()}, "
             f"torch {__import__('torch').__version__}; "
             f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC",
             f"- `configs/gpt-tiny-text.yaml`'s GPT (135K parameters) on the demo corpus "
             f"(`runs/demo-corpus/corpus.bin`, `make demo`'s), {WORLD} gloo ranks on 2 simulated nodes of {PER_NODE}, "
             f"fp32, ZeRO stage {STAGE}, "
             f"micro-batch {MICRO_BATCH} per rank, {steps} steps, the entrypoint `hybrid.models.gpt:train` with "
             f"the options in its model config's `zero:`; the numbers are the ranks' step reports "
             f"(metrics.jsonl's).",
             "- exact: `hierarchical: true, secondary_shard: node, param_persistence_threshold: 0` (every unit "
             "gathered); int8: the same with `quantized_weights: int8, quantized_gradients: int8` (block 256).",
             "",
             f"Loss (nats), mean of each {EVERY} steps:", "",
             "| steps | " + " | ".join(RUNS) + " |", "|---:|" + "---:|" * len(RUNS)]
    windows = len(res["exact"]["curve"])
    for i in range(windows):
        lo, hi = i * EVERY + 1, min((i + 1) * EVERY, steps)
        lines.append(f"| {lo}-{hi} | " + " | ".join(f"{res[n]['curve'][i]:.4f}" for n in RUNS) + " |")
    lines += ["", "| run | first loss | final loss (last 10) | bytes across nodes per step (rank 0) | "
                  "int8 error weights / gradients | seconds |", "|---|---:|---:|---:|---:|---:|"]
    for name in RUNS:
        r = res[name]
        err = (f"{r['errors']['weights']:.2e} / {r['errors']['gradients']:.2e}" if name == "int8" else "--")
        lines.append(f"| {name} | {r['first']:.4f} | {r['final']:.4f} | {r['inter']:,.0f} | {err} | "
                     f"{r['seconds']:.0f} |")
    lines += ["", f"int8 final loss vs exact: {gap:+.2%} (target within {TOLERANCE:.0%}: "
                  f"{'yes' if abs(gap) <= TOLERANCE else 'no'}); bytes across nodes per step: int8 "
                  f"{res['int8']['inter'] / res['exact']['inter']:.2f}x exact's.", ""]
    return lines


def replace_section(path: Path, lines: list[str]) -> None:
    text = path.read_text() if path.exists() else ""
    section = "\n".join(lines) + "\n"
    if SECTION in text:
        head, rest = text.split(SECTION, 1)
        nxt = rest.find("\n## ")
        text = head + section + (rest[nxt + 1:] if nxt >= 0 else "")
    else:
        text = text.rstrip("\n") + "\n\n" + section
    path.write_text(text)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    args = parser.parse_args(argv)
    from hybrid.runtime.local_launch import run_local

    started = time.perf_counter()
    prepare_corpus()
    ranks = run_local(_rank, WORLD, args.steps, timeout_s=3600)
    res = summarize(ranks[0])
    command = "python bench/quantized.py" + (f" --steps {args.steps}" if args.steps != 300 else "")
    lines = report(res, args.steps, command, (time.perf_counter() - started) / 60)
    print("\n".join(lines))
    if args.steps == 300:
        replace_section(ROOT / "bench" / "RESULTS.md", lines)
    gap = abs(res["int8"]["final"] - res["exact"]["final"]) / res["exact"]["final"]
    return 0 if gap <= TOLERANCE else 1


if __name__ == "__main__":
    sys.exit(main())
