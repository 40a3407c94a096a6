"""What every implementation trains: the model config, the batches, the optimizer settings.

``Workload`` is plain data (picklable, sent to every spawned rank). ``build_model`` builds the same
``hybrid.models.gpt.GPT`` with the same seed on every rank of every implementation, and ``batch`` gives
rank ``r`` its rows of the global batch of step ``s`` -- identical for every implementation, so the
losses can be compared step by step.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch


@dataclass(frozen=True)
class Workload:
    name: str                      # "4M", "4M-seq256", "100M", "quick"
    model: dict                    # GPTConfig fields
    micro_batch: int               # sequences per rank per step
    warmup: int                    # untimed steps (the last one is where model-state bytes are measured)
    steps: int                     # timed steps
    precision: str = "fp32"        # "fp32" | "bf16"
    seed: int = 0
    lr: float = 1e-3
    betas: tuple = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.1
    world_size: int = 2
    extra: dict = field(default_factory=dict)

    @property
    def seq_len(self) -> int:
        return self.model["seq_len"]

    @property
    def vocab_size(self) -> int:
        return self.model["vocab_size"]

    def with_precision(self, precision: str) -> "Workload":
        return replace(self, precision=precision)

    def with_world(self, world_size: int) -> "Workload":
        return replace(self, world_size=world_size)


# ~4M parameters: per-step overhead (hooks, launches, bookkeeping) dominates.
SMALL = dict(vocab_size=2048, seq_len=64, n_layers=4, hidden=256, n_heads=4)
# The same ~4M model on 16x the tokens per step (seq 256, micro-batch 8): compute-bound, where per-step
# overhead hardly shows and the gap to the compute floor is the cost of the parallelism itself.
COMPUTE = dict(vocab_size=2048, seq_len=256, n_layers=4, hidden=256, n_heads=4)
# ~100M parameters: parameter-sized work (optimizer, traffic) dominates. Short sequences keep `make bench`
# about 30 min on 2 cores.
LARGE = dict(vocab_size=8192, seq_len=64, n_layers=12, hidden=768, n_heads=12)
# Smoke test: seconds per implementation.
TINY = dict(vocab_size=256, seq_len=32, n_layers=2, hidden=64, n_heads=4)


def workloads(quick: bool) -> list[Workload]:
    if quick:
        return [Workload("quick", TINY, micro_batch=2, warmup=2, steps=1)]
    # Step counts sized so that `make bench` (13 rows with DeepSpeed x 3 workloads x 2 precisions x 2 passes)
    # takes about 30 min on 2 cores. Estimate per pass, from the step times of the 13.8-min single pass of
    # 2026-11-29 (start-up ~2.3 s a 4M row, ~6.8 s a 100M row) and short filtered runs of 4M-seq256
    # (~0.5-1.3 s/step): 4M 3+15 steps ~1.7 min, 4M-seq256 2+8 ~4.3 min, 100M 2+5 ~7.8 min; ~28 min for 2
    # passes on an idle machine (the run prints its own estimate after each pass).
    return [Workload("4M", SMALL, micro_batch=2, warmup=3, steps=15),
            Workload("4M-seq256", COMPUTE, micro_batch=8, warmup=2, steps=8),
            Workload("100M", LARGE, micro_batch=2, warmup=2, steps=5, lr=3e-4)]


def import_model_code() -> None:
    """Import what every implementation runs: the benchmark model's code and torch.optim's first-use import
    of ``torch._dynamo`` (~50 MB: every optimizer's constructor triggers it), so no row's RSS growth counts them."""
    import torch._dynamo  # noqa: F401

    import hybrid.models.gpt  # noqa: F401


def build_model(w: Workload) -> torch.nn.Module:
    """The benchmark model, fp32 on CPU, identical on every rank (same seed)."""
    from hybrid.models.gpt.model import GPT, GPTConfig

    return GPT(GPTConfig(**w.model), seed=w.seed)


def count_parameters(w: Workload) -> int:
    from hybrid.models.gpt.model import GPTConfig, count_parameters as count

    return count(GPTConfig(**w.model))


def batch(w: Workload, step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s (inputs, targets) of step ``step``: rows [rank*mb, (rank+1)*mb) of the global batch."""
    tokens = _tokens(w, step)
    rows = tokens[rank * w.micro_batch:(rank + 1) * w.micro_batch]
    return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()


def _tokens(w: Workload, step: int) -> torch.Tensor:
    """A learnable stream (a fixed successor map, 10% noise), so the loss falls within a few steps and a
    wrong optimizer shows up as diverging losses -- uniform random tokens would hide it at ln(vocab)."""
    successor = torch.randperm(w.vocab_size, generator=torch.Generator().manual_seed(w.seed))
    g = torch.Generator().manual_seed(w.seed * 1_000_003 + step + 1)
    rows, cols = w.world_size * w.micro_batch, w.seq_len + 1
    noise = torch.randint(0, w.vocab_size, (rows, cols), generator=g)
    keep = torch.rand(rows, cols, generator=g) > 0.1
    out = torch.empty(rows, cols, dtype=torch.long)
    out[:, 0] = noise[:, 0]
    for i in range(1, cols):
        out[:, i] = torch.where(keep[:, i], successor[out[:, i - 1]], noise[:, i])
    return out
