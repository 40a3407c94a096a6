"""Global gradient norm over the DP shards and the TP group, and the clip coefficient of ``clip_grad_norm_``.

Each rank sums the squares of the gradient elements it owns, split into two sums: elements of
tensor-parallel parameters (``hybrid.param_attrs``: each TP rank holds a different slice) and of replicated
ones. Both sums are added over the DP group when the gradients are sharded (stages 1-3; at stage 0 every
rank already holds every element). The TP sum is then added over the TP group, the replicated sum is not
(every TP rank holds the same values), so the norm is that of the full single-process model.
"""

from __future__ import annotations

from typing import Optional

import torch

from hybrid.comm import Comm


def global_grad_norm(runs: list, dp_comm: Optional[Comm], tp_comm: Optional[Comm], chunk: int) -> torch.Tensor:
    """The 2-norm (fp32, 0-dim) of all gradients; ``runs`` are ``(grad_view, is_tensor_parallel)`` pairs."""
    device = runs[0][0].device if runs else torch.device("cpu")
    sums = torch.zeros(2, dtype=torch.float64, device=device)  # [tensor-parallel, replicated]
    for grad, is_tp in runs:
        for lo in range(0, grad.numel(), chunk):
            norm = torch.linalg.vector_norm(grad[lo:lo + chunk], 2, dtype=torch.float32)
            sums[0 if is_tp else 1] += norm.double() ** 2
    if dp_comm is not None:
        dp_comm.all_reduce(sums)
    if tp_comm is not None and tp_comm.size > 1:
        tp_part = sums[:1].clone()
        tp_comm.all_reduce(tp_part)
        sums[0] = tp_part[0]
    return sums.sum().sqrt().float()


def clip_coefficient(total_norm: torch.Tensor, max_norm: float) -> torch.Tensor:
    """``min(max_norm / (norm + 1e-6), 1)`` computed as ``torch.nn.utils.clip_grad_norm_`` does."""
    return torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)
