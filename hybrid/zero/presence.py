"""Parameters that got no gradient in a step are left alone, as torch's optimizers leave a ``grad`` of None.

In the single-process run over the global batch, a parameter nothing used in a step (the cross-attention of an
encoder-decoder model run decoder-only, a vision tower beside a text-only batch, an expert no token chose) has
no gradient, and ``torch.optim`` skips it: no weight decay, its moments and its step count untouched. The
engine's flat buffers hold zeros there instead, which AdamW would still decay. ``GradPresence.skipped(got)``
(``got``: which parameters' post-accumulate hooks fired on this rank in any micro-step of the step) sums over
the DP group which parameters got none, and returns those that got none on any rank; the optimizer then steps
them as torch would (``FlatOptimizer.step(skip=...)``).

It costs one small all-reduce over the DP group each step (4 bytes a parameter, not a byte of Ψ), counted with
the step's traffic; a DP group of one costs nothing.
"""

from __future__ import annotations

from typing import Sequence

import torch

from hybrid.comm.collectives import Comm


class GradPresence:
    def __init__(self, dp_comm: Comm):
        self.comm = dp_comm

    @torch.no_grad()
    def skipped(self, got: Sequence[bool], device: torch.device) -> frozenset:
        """The indices of the parameters that got no gradient on any DP rank this step."""
        if self.comm.solo:
            return frozenset(i for i, g in enumerate(got) if not g)
        missing = torch.tensor([0.0 if g else 1.0 for g in got], dtype=torch.float32, device=device)
        self.comm.all_reduce(missing)
        ranks = self.comm.size
        return frozenset(i for i, count in enumerate(missing.tolist()) if count == ranks)
