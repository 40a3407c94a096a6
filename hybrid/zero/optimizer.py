"""AdamW on this rank's flat fp32 shard, stepped in ``sub_group_size`` pieces.

``adamw_update_`` is the arithmetic of ``torch.optim.AdamW(foreach=False)`` (the single-tensor path torch
uses on CPU), op for op, on flat fp32 tensors: decoupled weight decay ``p *= 1 - lr·wd``, ``m.lerp_(g,
1-β1)``, ``v = β2·v + (1-β2)·g²``, ``p -= lr/(1-β1^t) · m / (sqrt(v)/sqrt(1-β2^t) + eps)``. With
``decoupled=False`` it is ``torch.optim.Adam``'s L2 form (``g += wd·p``). All ops are elementwise, so cutting
the shard into pieces does not change the result.

``ShardedAdamW`` runs the same update through torch's fused Adam(W) kernel (``torch._fused_adamw_``, one
vectorized pass instead of seven elementwise ops: ~7x faster on CPU, the kernel behind
``torch.optim.AdamW(fused=True)``) wherever torch has it, and the op-by-op ``adamw_update_`` elsewhere or with
``fused=False``. The two agree to the last bit or two of each element (rounding order), not bit for bit.

``ShardedAdamW`` owns the Adam moments of the shard (one fp32 buffer each, in shard space) and steps a
list of ``Segment``s: the fp32 master view, the gradient view (model dtype) and, when the model dtype is
not fp32, the view of the model parameters that receives the updated values. Temporaries (the fp32 copy of
a bf16 gradient) never exceed ``sub_group_size`` elements. Every parameter takes a step each time, a
parameter without a gradient in a step has a zero gradient (as with ``zero_grad(set_to_none=False)``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from hybrid.config import OptimizerConfig


@dataclass
class Segment:
    master: torch.Tensor            # fp32, updated in place
    grad: torch.Tensor              # same length, model dtype
    pos: int                        # where the segment starts in shard space (moments)
    out: Optional[torch.Tensor]     # model-dtype copy of the master, or None when the master is the param


@torch.no_grad()
def adamw_update_(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                  step: int, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float,
                  decoupled: bool = True) -> None:
    """One Adam(W) step on flat fp32 tensors, identical to torch's single-tensor implementation."""
    if weight_decay != 0:
        if decoupled:
            param.mul_(1 - lr * weight_decay)
        else:
            grad = grad.add(param, alpha=weight_decay)
    exp_avg.lerp_(grad, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    bias_correction1 = 1 - beta1 ** step
    bias_correction2 = 1 - beta2 ** step
    step_size = lr / bias_correction1
    denom = (exp_avg_sq.sqrt() / bias_correction2 ** 0.5).add_(eps)
    param.addcdiv_(exp_avg, denom, value=-step_size)


def fused_kernel(decoupled: bool):
    """torch's fused Adam(W) kernel for flat tensors, or None where this torch has none."""
    return getattr(torch, "_fused_adamw_" if decoupled else "_fused_adam_", None)


class ShardedAdamW:
    def __init__(self, segments: list, shard_numel: int, device, hyper: OptimizerConfig, sub_group_size: int,
                 fused: bool = True):
        self.segments = segments
        self.exp_avg = torch.zeros(shard_numel, dtype=torch.float32, device=device)
        self.exp_avg_sq = torch.zeros(shard_numel, dtype=torch.float32, device=device)
        self.lr = hyper.lr
        self.betas = hyper.betas
        self.eps = hyper.eps
        self.weight_decay = hyper.weight_decay
        self.decoupled = hyper.decoupled_weight_decay
        self.sub_group_size = sub_group_size
        self.step_count = 0
        self._fused = fused_kernel(self.decoupled) if fused else None

    def pieces(self):
        """``(segment, lo, hi)`` for every piece of at most ``sub_group_size`` elements."""
        for seg in self.segments:
            n = seg.master.numel()
            for lo in range(0, n, self.sub_group_size):
                yield seg, lo, min(n, lo + self.sub_group_size)

    @torch.no_grad()
    def step(self, grad_scale: Optional[torch.Tensor] = None) -> None:
        """Step every segment; ``grad_scale`` (a 0-dim fp32 tensor) multiplies the gradients first."""
        self.step_count += 1
        beta1, beta2 = self.betas
        step = None
        if self._fused is not None:
            step = torch.tensor(float(self.step_count), dtype=torch.float32, device=self.exp_avg.device)
        for seg, lo, hi in self.pieces():
            grad = seg.grad[lo:hi]
            grad = grad.float() if grad.dtype != torch.float32 else grad
            if grad_scale is not None:
                grad = grad.mul(grad_scale)
            a, b = seg.pos + lo, seg.pos + hi
            if step is not None:
                self._fused([seg.master[lo:hi]], [grad], [self.exp_avg[a:b]], [self.exp_avg_sq[a:b]], [], [step],
                            lr=self.lr, beta1=beta1, beta2=beta2, weight_decay=self.weight_decay, eps=self.eps,
                            amsgrad=False, maximize=False)
            else:
                adamw_update_(seg.master[lo:hi], grad, self.exp_avg[a:b], self.exp_avg_sq[a:b], self.step_count,
                              self.lr, beta1, beta2, self.eps, self.weight_decay, self.decoupled)
            if seg.out is not None:
                seg.out[lo:hi].copy_(seg.master[lo:hi])

    @torch.no_grad()
    def copy_master_to_params(self) -> None:
        for seg, lo, hi in self.pieces():
            if seg.out is not None:
                seg.out[lo:hi].copy_(seg.master[lo:hi])
