"""A synthetic token stream that a small model can learn, identical on every rank for a given step.

``MarkovTokens`` draws sequences from a fixed random first-order Markov chain: every token has
``branching`` possible successors, picked uniformly. A model that learns the table reaches a loss of
``log(branching)`` (1.39 for 4) from ``log(vocab_size)`` at the start, so training visibly works within a
few dozen steps. ``batch(step, ...)`` builds the step's global batch from a generator seeded by
``(seed, step)`` alone and returns one data-parallel rank's slice of it: the same step always yields the
same data, whatever the rank, the restart or the DP degree.
"""

from __future__ import annotations

import math

import torch


class MarkovTokens:
    def __init__(self, vocab_size: int, seq_len: int, seed: int = 0, branching: int = 4):
        if branching > vocab_size:
            raise ValueError(f"branching ({branching}) cannot exceed vocab_size ({vocab_size})")
        self.vocab_size, self.seq_len, self.seed, self.branching = vocab_size, seq_len, seed, branching
        g = torch.Generator().manual_seed(seed)
        # Distinct successors per token, so the entropy floor is exactly log(branching).
        self.successors = torch.stack([torch.randperm(vocab_size, generator=g)[:branching]
                                       for _ in range(vocab_size)])

    @property
    def loss_floor(self) -> float:
        """The cross-entropy of a model that knows the chain perfectly."""
        return math.log(self.branching)

    def global_batch(self, step: int, rows: int) -> torch.Tensor:
        """``rows`` sequences of ``seq_len + 1`` tokens for ``step``, the same on every call."""
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        tokens = torch.empty(rows, self.seq_len + 1, dtype=torch.long)
        tokens[:, 0] = torch.randint(self.vocab_size, (rows,), generator=g)
        picks = torch.randint(self.branching, (rows, self.seq_len), generator=g)
        for t in range(self.seq_len):
            tokens[:, t + 1] = self.successors[tokens[:, t], picks[:, t]]
        return tokens

    def batch(self, step: int, micro_batch: int, dp_rank: int = 0, dp: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets) of DP rank ``dp_rank``: its ``micro_batch`` rows of the step's global batch of
        ``micro_batch · dp`` rows; targets are the inputs shifted by one token."""
        tokens = self.global_batch(step, micro_batch * dp)[dp_rank * micro_batch:(dp_rank + 1) * micro_batch]
        return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
