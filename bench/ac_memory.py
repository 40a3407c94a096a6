"""Activation checkpointing, measured: peak RSS growth of one training step of the built-in GPT with and
without it, beside the memory model's activation figures for both.

Each variant runs in a fresh process (one thread), so ``ru_maxrss`` is its own: the growth is measured from
just before the first forward to the end of the first backward, i.e. the activations held at the start of
backward (model states are allocated before the baseline is taken).

    .venv/bin/python bench/ac_memory.py [--seq 256 --micro-batch 8 --hidden 256 --layers 4]
"""

from __future__ import annotations

import argparse
import dataclasses
import multiprocessing as mp
import os
import resource
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _rss() -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmRSS"))


def _step_growth(cfg, micro_batch: int, precision: str, queue) -> None:
    import torch

    import hybrid
    from hybrid.models.gpt.model import GPT

    torch.set_num_threads(1)
    engine = hybrid.initialize(GPT(cfg, device="meta"), {"zero_optimization": {"stage": 0}, "precision": precision})
    ids = torch.randint(0, cfg.vocab_size, (micro_batch, cfg.seq_len + 1), generator=torch.Generator().manual_seed(0))
    warm = torch.randint(0, cfg.vocab_size, (1, 9))
    engine.backward(engine(warm[:, :-1], warm[:, 1:]))  # fault in kernels and autograd once, tiny
    engine.step()
    before = _rss()
    loss = engine(ids[:, :-1], ids[:, 1:])
    engine.backward(loss)
    queue.put(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before)


def main(argv=None) -> int:
    from hybrid.models.gpt.config import GPTConfig
    from launch.planning.model_size import gpt_figures

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--precision", default="fp32", choices=["fp32", "bf16"])
    args = parser.parse_args(argv)
    base = GPTConfig(vocab_size=args.vocab, seq_len=args.seq, hidden=args.hidden, n_layers=args.layers,
                     n_heads=max(1, args.hidden // 64))
    ctx = mp.get_context("spawn")
    print(f"GPT hidden {args.hidden}, {args.layers} layers, seq {args.seq}, micro-batch {args.micro_batch}, "
          f"{args.precision}, one process, one thread")
    print("| activation checkpointing | measured peak growth MiB | estimated activations MiB | measured / estimated |")
    print("|---|---|---|---|")
    measured = {}
    for ac in (False, True):
        queue = ctx.Queue()
        proc = ctx.Process(target=_step_growth, args=(dataclasses.replace(base, activation_checkpointing=ac),
                                                      args.micro_batch, args.precision, queue))
        proc.start()
        growth = queue.get(timeout=600)
        proc.join()
        estimate = gpt_figures(base.to_dict(), args.precision).activation_bytes(args.micro_batch, 1, ac)
        measured[ac] = growth
        print(f"| {'on' if ac else 'off'} | {growth / 2**20:.1f} | {estimate / 2**20:.1f} | {growth / estimate:.2f} |")
    print(f"activation checkpointing keeps {measured[True] / measured[False]:.2f}x the memory of a plain step")
    return 0


if __name__ == "__main__":
    sys.exit(main())
