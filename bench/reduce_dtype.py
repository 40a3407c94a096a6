"""Gradient reduction dtype for bf16, measured: the loss of bf16 training with gradients reduced (and
accumulated) in bf16 and in fp32 (``zero.reduce_dtype``), each against fp32 training of the same GPT on the
same batches, world size 2 (gloo, CPU), ZeRO stage 2, gradient accumulation 2.

    .venv/bin/python bench/reduce_dtype.py [--steps 60]

Prints, per variant, the mean and the largest |loss - fp32 loss| over the steps, and the final losses.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.workload import SMALL, Workload, batch  # noqa: E402

ACCUM = 2


def _train(precision: str, reduce_dtype, steps: int) -> list:
    import torch
    import torch.distributed as dist

    import hybrid
    from hybrid.models.gpt.model import GPT, GPTConfig

    torch.set_num_threads(1)
    w = Workload("4M", SMALL, micro_batch=2, warmup=0, steps=steps)
    zero = {"stage": 2, **({"reduce_dtype": reduce_dtype} if reduce_dtype else {})}
    engine = hybrid.initialize(GPT(GPTConfig(**SMALL), device="meta"),
                               {"zero_optimization": zero, "bf16": {"enabled": precision == "bf16"},
                                "optimizer": {"lr": 1e-3, "betas": [0.9, 0.95], "weight_decay": 0.1},
                                "gradient_accumulation_steps": ACCUM})
    rank, losses = dist.get_rank(), []
    for step in range(steps):
        total = 0.0
        for micro in range(ACCUM):
            x, y = batch(w, step * ACCUM + micro, rank)
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            total += loss.item() / ACCUM
        t = torch.tensor([total])
        dist.all_reduce(t)
        losses.append(t.item() / dist.get_world_size())
    return losses


def main(argv=None) -> int:
    from hybrid.runtime.local_launch import run_local

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=60)
    args = ap.parse_args(argv)
    runs = {name: run_local(_train, 2, precision, reduce, args.steps, timeout_s=900, threads=1)[0]
            for name, precision, reduce in (("fp32", "fp32", None), ("bf16, reduce bf16", "bf16", "bf16"),
                                            ("bf16, reduce fp32", "bf16", "fp32"))}
    ref = runs["fp32"]
    print(f"GPT {SMALL}, world 2, stage 2, accumulation {ACCUM}, {args.steps} steps")
    print("| variant | mean abs loss diff vs fp32 | max abs loss diff | final loss (fp32: %.4f) |" % ref[-1])
    print("|---|---|---|---|")
    for name, losses in runs.items():
        if name == "fp32":
            continue
        diffs = [abs(a - b) for a, b in zip(losses, ref)]
        print(f"| {name} | {sum(diffs) / len(diffs):.4f} | {max(diffs):.4f} | {losses[-1]:.4f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
