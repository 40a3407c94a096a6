"""The optimizer step on CPU, one checkout against another: ``engine.step()`` alone (gradient norm with
clipping, AdamW on the shard, the parameter refresh), one process, one thread, world size 1, ZeRO stage 1;
the thread's CPU time (what a loaded machine disturbs least) and the wall time.

    .venv/bin/python bench/optim_step.py --before /path/to/baseline/checkout [--passes 3] [--steps 15]
    .venv/bin/python bench/optim_step.py --before /path/to/baseline/checkout --optimizer-only [--steps 40]

Each pass measures every (model, precision) row in a fresh process per variant, the variants alternating:
the baseline, this checkout, and this checkout under the GPU's step rule (``BENCH_GPU_RULE=1``: no conversion
limit on CPU, one call per batch: what the CPU's rule is weighed against). A row's time is the median of its
timed steps, the lower median over the passes. Prints a Markdown table with the ratios to the baseline
(< 1: faster now).
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

    if os.environ.get("BENCH_GPU_RULE"):  # this checkout with the GPU's step rule: no conversion limit on CPU
        from hybrid.plan import layout

        layout.CONVERT_LIMITS.pop("cpu")
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


def optimizer_ab(before: str, steps: int) -> list:
    """``FlatOptimizer.step`` alone, the baseline's module (loaded from ``before``) and this checkout's in one
    process, stepped alternately on identical shards shaped like the 25M GPT's parameters (one thread, a clip
    scale, a bf16 or fp32 parameter view receiving each update): what a loaded machine disturbs least.
    Returns ``(precision, elements, before ms, after ms)`` rows, medians over ``steps``."""
    import importlib.util
    import statistics
    import time

    import torch

    sys.path.insert(0, HERE)
    from hybrid.config.training import OptimizerConfig
    from hybrid.zero import optimizer as after_module
    from hybrid.zero.param_groups import Group

    spec = importlib.util.spec_from_file_location("baseline_optimizer", os.path.join(before, "hybrid/zero/optimizer.py"))
    before_module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = before_module
    spec.loader.exec_module(before_module)
    torch.set_num_threads(1)
    h, v, layers = MODELS["25M"]["hidden"], MODELS["25M"]["vocab_size"], MODELS["25M"]["n_layers"]
    sizes = [v * h] + [h * 3 * h, 3 * h, h * h, h, h * 4 * h, 4 * h, 4 * h * h, h, h, h, h, h] * layers
    n = sum(sizes)
    rows = []
    for precision, dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
        def build(module):
            torch.manual_seed(0)
            master, grad, out = torch.randn(n), torch.randn(n).to(dtype), torch.zeros(n, dtype=dtype)
            pieces, at = [], 0
            for size in sizes:
                pieces.append(module.Piece(master[at:at + size], grad[at:at + size], at, out[at:at + size],
                                           0 if size > 4 * h else 1))
                at += size
            return module.FlatOptimizer(pieces, n, "cpu", OptimizerConfig(lr=1e-3, weight_decay=0.1), 10**9,
                                        [Group(0.1), Group(0.0)])
        optimizers = {"before": build(before_module), "after": build(after_module)}
        scale, times = torch.tensor(0.5), {name: [] for name in optimizers}
        for step in range(3 + steps):
            for name, opt in optimizers.items():
                start = time.thread_time()
                opt.step([1e-3, 1e-3], scale)
                if step >= 3:
                    times[name].append(time.thread_time() - start)
        rows.append((precision, n, *(1e3 * statistics.median(times[name]) for name in optimizers)))
    return rows


def _run(tree: str, model: str, precision: str, steps: int, gpu_rule: bool = False) -> dict:
    env = {**os.environ, "PYTHONPATH": tree, "OMP_NUM_THREADS": "1", **({"BENCH_GPU_RULE": "1"} if gpu_rule else {})}
    out = subprocess.run([sys.executable, os.path.abspath(__file__), "--measure", model, precision,
                          "--steps", str(steps)], env=env, cwd=tree, check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", help="the baseline checkout (its root)")
    ap.add_argument("--passes", type=int, default=3)
    ap.add_argument("--steps", type=int, default=15)
    ap.add_argument("--optimizer-only", action="store_true",
                    help="FlatOptimizer.step alone, both checkouts in this one process (optimizer_ab)")
    ap.add_argument("--measure", nargs=2, metavar=("MODEL", "PRECISION"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.measure:
        print(json.dumps(measure(*args.measure, steps=args.steps)))
        return 0
    if not args.before:
        ap.error("--before: the baseline checkout to compare with")
    before = os.path.abspath(args.before)
    if args.optimizer_only:
        print("| precision | elements | CPU ms: before | after | after / before |")
        print("|---|---:|---:|---:|---:|")
        for precision, n, t_before, t_after in optimizer_ab(before, args.steps):
            print(f"| {precision} | {n / 1e6:.1f}M | {t_before:.2f} | {t_after:.2f} | {t_after / t_before:.3f} |")
        return 0
    variants = {"before": (before, False), "after": (HERE, False), "GPU rule": (HERE, True)}
    runs = {(row, name): [] for row in ROWS for name in variants}
    for _ in range(args.passes):
        for row in ROWS:
            for name, (tree, gpu_rule) in variants.items():
                result = _run(tree, *row, args.steps, gpu_rule)
                assert os.path.realpath(result["hybrid"]).startswith(os.path.realpath(tree)), result
                runs[row, name].append(result)
    print("| model | precision | params | CPU ms: before | after | GPU rule | after / before | GPU rule / before "
          "| wall ms: before | after | after / before |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for row in ROWS:
        t = {(key, name): 1e3 * sorted(r[key] for r in runs[row, name])[(args.passes - 1) // 2]
             for key in ("cpu_s", "step_s") for name in variants}
        cpu = {name: t["cpu_s", name] for name in variants}
        wall = {name: t["step_s", name] for name in variants}
        print(f"| {row[0]} | {row[1]} | {runs[row, 'after'][0]['params'] / 1e6:.1f}M | {cpu['before']:.2f} | "
              f"{cpu['after']:.2f} | {cpu['GPU rule']:.2f} | {cpu['after'] / cpu['before']:.3f} | "
              f"{cpu['GPU rule'] / cpu['before']:.3f} | {wall['before']:.2f} | {wall['after']:.2f} | "
              f"{wall['after'] / wall['before']:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
