"""Global gradient norm over the DP shards and the TP group, and the clip coefficient of ``clip_grad_norm_``.

Each rank sums the squares of the gradient elements it owns, split into two sums: elements of
tensor-parallel parameters (``hybrid.weights.attrs``: each TP rank holds a different slice) and of replicated
ones. Both sums are added over the DP group when the gradients are sharded (stages 1-3; at stage 0 every
rank already holds every element). The TP sum is then added over the TP group, the replicated sum is not
(every TP rank holds the same values), so the norm is that of the full single-process model. A non-finite
replicated sum still reaches every TP rank (it turns the TP sum NaN before that is reduced), so every rank
of the job sees a finite norm or every rank sees a non-finite one, and they agree on skipping a step.

``NonFiniteGuard`` is that decision: a step whose norm is NaN or inf is skipped (the engine leaves weights,
moments and the optimizer's step count untouched and zeroes the gradients); ``max_consecutive`` such steps
in a row end the job with ``NonFiniteError`` (one sentence, raised on every rank alike).
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from hybrid.comm.collectives import Comm
from hybrid.errors import NonFiniteError
from hybrid.plan.layout import CONVERT_NUMEL


def global_grad_norm(runs: list, dp_comm: Optional[Comm], tp_comm: Optional[Comm], chunk: int,
                     scratch=None) -> torch.Tensor:
    """The 2-norm (fp32, 0-dim) of all gradients; ``runs`` are ``(grad_view, is_tensor_parallel)`` pairs;
    ``scratch`` (``optimizer.Fp32Scratch``, a new one when None) stages non-fp32 gradients in fp32."""
    device = runs[0][0].device if runs else torch.device("cpu")
    sums = torch.zeros(2, dtype=torch.float64, device=device)  # [tensor-parallel, replicated]
    for k, flag in enumerate((True, False)):
        pieces = [grad[lo:lo + chunk] for grad, is_tp in runs if is_tp == flag and grad.numel()
                  for lo in range(0, grad.numel(), chunk)]
        if pieces:  # no host sync
            sums[k] = torch.stack(_norms(pieces, scratch)).double().square().sum()
    if dp_comm is not None:
        dp_comm.all_reduce(sums)
    if tp_comm is not None and not tp_comm.solo:
        tp_part = sums[:1] + (sums[1:] - sums[1:])  # + 0 exactly, or NaN when the replicated sum is not finite
        tp_comm.all_reduce(tp_part)
        sums[0] = tp_part[0]
    return sums.sum().sqrt().float()


def _norms(pieces: list, scratch) -> list:
    """fp32 2-norms of ``pieces``: fp32 ones in one ``torch._foreach_norm``; others converted a bounded
    chunk at a time into the reused fp32 scratch (a norm with ``dtype=float32`` would upcast a whole copy)."""
    from hybrid.zero.optimizer import Fp32Scratch

    fp32 = [p for p in pieces if p.dtype == torch.float32]
    out = list(torch._foreach_norm(fp32, 2)) if fp32 else []
    other = [p for p in pieces if p.dtype != torch.float32]
    if other:
        buf = (scratch or Fp32Scratch()).view(min(CONVERT_NUMEL, max(p.numel() for p in other)), other[0].device)
        for p in other:
            for lo in range(0, p.numel(), buf.numel()):
                part = p[lo:lo + buf.numel()]
                out.append(torch.linalg.vector_norm(buf[:part.numel()].copy_(part), 2))
    return out


def clip_coefficient(total_norm: torch.Tensor, max_norm: float) -> torch.Tensor:
    """``min(max_norm / (norm + 1e-6), 1)`` computed as ``torch.nn.utils.clip_grad_norm_`` does."""
    return torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)


class NonFiniteGuard:
    """Whether to skip a step for its global gradient norm, and when to give up."""

    def __init__(self, max_consecutive: int):
        self.max_consecutive = max_consecutive
        self.consecutive = 0  # non-finite norms in a row, up to the latest step
        self.skipped = 0      # steps skipped so far by this engine

    def skip(self, norm: float) -> bool:
        """True when the step with this norm must be skipped; raises NonFiniteError at the
        ``max_consecutive``-th non-finite norm in a row."""
        if math.isfinite(norm):
            self.consecutive = 0
            return False
        self.consecutive += 1
        self.skipped += 1
        if self.consecutive >= self.max_consecutive:
            raise NonFiniteError(
                f"the global gradient norm was {norm} for {self.consecutive} consecutive steps "
                f"(max_nonfinite_skips = {self.max_consecutive}), so training has diverged; lower the learning "
                f"rate, set gradient_clipping, check the data, or resume from an earlier checkpoint.")
        return True
