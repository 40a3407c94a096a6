"""What stage 3's out-of-unit read detection costs a forward: a small GPT's stage-3 forward (one process,
no_grad, one thread) timed with the engine's guard and with the guard replaced by a null context.

    .venv/bin/python bench/stage3_guard_cost.py

Prints the median forward time of both, in alternating blocks of 50 forwards.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository root


def main() -> int:
    import torch

    import hybrid
    from hybrid.models import GPT, GPTConfig

    torch.set_num_threads(1)
    cfg = GPTConfig(vocab_size=256, seq_len=16, n_layers=4, hidden=64, n_heads=4)
    engine = hybrid.initialize(GPT(cfg, seed=0), {"zero_optimization": {"stage": 3,
                                                                          "stage3_param_persistence_threshold": 0}})
    x = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len))
    guard = engine.gatherer.guard
    times = {"guard": [], "none": []}
    with torch.no_grad():
        for block in range(10):
            for name in ("guard", "none") if block % 2 == 0 else ("none", "guard"):
                engine.gatherer.guard = guard if name == "guard" else contextlib.nullcontext
                t0 = time.perf_counter()
                for _ in range(50):
                    engine(x, x)
                times[name].append((time.perf_counter() - t0) / 50 * 1e3)
    engine.gatherer.guard = guard
    med = {name: statistics.median(t) for name, t in times.items()}
    print(f"stage-3 forward: {med['guard']:.3f} ms with the guard, {med['none']:.3f} ms without "
          f"({med['guard'] / med['none']:.2f}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
