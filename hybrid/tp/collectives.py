"""The four autograd collective pairs of Megatron-style tensor parallelism, each defined once.

Each function takes the TP ``Comm`` (``hybrid.comm``), so TP traffic is counted apart from DP traffic.
A ``None`` comm or one that moves nothing (``Comm.solo``: a group of one, unless ``HYBRID_FORCE_COLLECTIVES=1``
makes it communicate) makes every function the identity.

=============================  ======================  ======================
function                       forward                 backward
=============================  ======================  ======================
``copy_to_tp_region``          identity                all-reduce (sum)
``reduce_from_tp_region``      all-reduce (sum)        identity
``scatter_to_tp_region``       split the last dim      all-gather last dim
``gather_from_tp_region``      all-gather last dim     split the last dim
=============================  ======================  ======================

Split and gather work on the last dimension in rank order: rank r owns columns
``[r·d/t, (r+1)·d/t)``.

The forward all-reduce is in place on the layers' own partial results (``consume=True``: a fresh, contiguous
tensor no one else holds, the row-parallel matmul's output), marked dirty for autograd; a caller's tensor is
cloned first, so it keeps its value. The backward
all-reduce always works on a copy: autograd may hand the same gradient tensor to several inputs.
"""

from __future__ import annotations

from typing import Optional

import torch

from hybrid.comm.collectives import Comm
from hybrid.tp.sharding import gather_tp_tensor


def _solo(comm: Optional[Comm]) -> bool:
    return comm is None or comm.solo


def _all_reduce(x: torch.Tensor, comm: Comm) -> torch.Tensor:
    out = x.contiguous().clone()
    comm.all_reduce(out)
    return out


def _split_last(x: torch.Tensor, comm: Comm) -> torch.Tensor:
    if x.shape[-1] % comm.size:
        raise ValueError(f"cannot split a last dimension of {x.shape[-1]} across {comm.size} TP ranks")
    return x.chunk(comm.size, dim=-1)[comm.rank].contiguous()


def _gather_last(x: torch.Tensor, comm: Comm) -> torch.Tensor:
    return gather_tp_tensor(x, -1, comm)


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.comm), None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm, consume):
        if consume and x.is_contiguous() and x._base is None and not x.is_leaf:
            comm.all_reduce(x)
            ctx.mark_dirty(x)
            return x
        return _all_reduce(x, comm)

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


class _ScatterToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        return _split_last(x, comm)

    @staticmethod
    def backward(ctx, grad):
        return _gather_last(grad, ctx.comm), None


class _GatherFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        return _gather_last(x, comm)

    @staticmethod
    def backward(ctx, grad):
        return _split_last(grad, ctx.comm), None


def copy_to_tp_region(x: torch.Tensor, comm: Optional[Comm]) -> torch.Tensor:
    """Enter the TP region: identity forward, sum the input gradients of all TP ranks backward."""
    return x if _solo(comm) else _CopyToTP.apply(x, comm)


def reduce_from_tp_region(x: torch.Tensor, comm: Optional[Comm], *, consume: bool = False) -> torch.Tensor:
    """Leave the TP region by summing partial results: all-reduce forward, identity backward.

    ``consume=True`` (the layers' own matmul outputs, which nothing else holds) all-reduces ``x`` in place
    and returns it; otherwise ``x`` is left as it was and the sum is a new tensor."""
    return x if _solo(comm) else _ReduceFromTP.apply(x, comm, consume)


def scatter_to_tp_region(x: torch.Tensor, comm: Optional[Comm]) -> torch.Tensor:
    """Keep this rank's slice of the last dim forward; all-gather the gradient backward."""
    return x if _solo(comm) else _ScatterToTP.apply(x, comm)


def gather_from_tp_region(x: torch.Tensor, comm: Optional[Comm]) -> torch.Tensor:
    """All-gather the last dim forward; keep this rank's slice of the gradient backward."""
    return x if _solo(comm) else _GatherFromTP.apply(x, comm)
