"""The optimizer step on CPU, one checkout against another: ``engine.step()`` alone (gradient norm with
clipping, AdamW on the shard, the parameter refresh), one process, one thread, world size 1, ZeRO stage 1;
the thread's CPU time (what a loaded machine disturbs least) and the wall time.

    .venv/bin/python bench/optim_step.py --before /path/to/baseline/checkout [--passes 3] [--steps 15]

Each pass measures every (model, precision) row in a fresh process per checkout, the two checkouts
alternating; a row's time is the median of its timed steps, the lower median over the passes. Prints a
Markdown table with this checkout's time over the baseline's (< 1: faster now).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODELS = {  # the bench's small GPT (bench/workload.py) and one of 6x its parameters
    "4M": dict(vocab_size=2048, seq_len=64, n_layers=4, hidden=256, n_heads=4),
    "25M": dict(vocab_size=8192, seq_len=64, n_layers=6, hidden=512, n_heads=8),
}
ROWS = [(model, precision) for model in MODELS for precision in ("bf16", "fp32")]


def measure(model: str, precision: str, steps: int, warmup: int = 3) -> dict:
    """Median ``engine.step()`` seconds of ``model`` in ``precision`` (runs in the checkout on sys.path)."""
    import statistics
    import time

    import torch

    import hybrid
    from hybrid.models.gpt.model import GPT, GPTConfig

    torch.set_num_threads(1)
    torch.manual_seed(0)
    shape = MODELS[model]
    engine = hybrid.initialize(GPT(GPTConfig(**shape), device="meta"),
                               {"zero_optimization": {"stage": 1}, "bf16": {"enabled": precision == "bf16"},
                                "optimizer": {"lr": 1e-3, "betas": [0.9, 0.95], "weight_decay": 0.1},
                                "gradient_clipping": 1.0})
    x = torch.randint(0, shape["vocab_size"], (2, shape["seq_len"]))
    times, cpu = [], []
    for step in range(warmup + steps):
        engine.backward(engine(x, x))
        start, start_cpu = time.perf_counter(), time.thread_time()
        engine.step()
        if step >= warmup:
            times.append(time.perf_counter() - start)
            cpu.append(time.thread_time() - start_cpu)
    return {"model": model, "precision": precision, "step_s": statistics.median(times),
            "cpu_s": statistics.median(cpu),
            "params": sum(p.numel() for p in engine.module.parameters()), "hybrid": hybrid.__file__}


def _run(tree: str, model: str, precision: str, steps: int) -> dict:
    env = {**os.environ, "PYTHONPATH": tree, "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, os.path.abspath(__file__), "--measure", model, precision,
                          "--steps", str(steps)], env=env, cwd=tree, check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", help="the baseline checkout (its root)")
    ap.add_argument("--passes", type=int, default=3)
    ap.add_argument("--steps", type=int, default=15)
    ap.add_argument("--measure", nargs=2, metavar=("MODEL", "PRECISION"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.measure:
        print(json.dumps(measure(*args.measure, steps=args.steps)))
        return 0
    if not args.before:
        ap.error("--before: the baseline checkout to compare with")
    trees = {"before": os.path.abspath(args.before), "after": HERE}
    runs = {(row, name): [] for row in ROWS for name in trees}
    for _ in range(args.passes):
        for row in ROWS:
            for name, tree in trees.items():
                result = _run(tree, *row, args.steps)
                assert os.path.realpath(result["hybrid"]).startswith(os.path.realpath(tree)), result
                runs[row, name].append(result)
    print("| model | precision | params | CPU before (ms) | CPU after (ms) | CPU after / before | wall before (ms) "
          "| wall after (ms) | wall after / before |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for row in ROWS:
        line = f"| {row[0]} | {row[1]} | {runs[row, 'after'][0]['params'] / 1e6:.1f}M |"
        for key in ("cpu_s", "step_s"):
            t = {name: sorted(r[key] for r in runs[row, name])[(args.passes - 1) // 2] for name in trees}
            line += f" {1e3 * t['before']:.2f} | {1e3 * t['after']:.2f} | {t['after'] / t['before']:.3f} |"
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
