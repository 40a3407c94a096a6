"""Marks on parameters that the TP layers set and the ZeRO engine reads.

A parameter is *tensor-parallel* when each TP rank holds a different slice of it (column/row parallel
weights, vocab-parallel embeddings). Every other parameter (layer norms, row-parallel biases, position
embeddings) is *replicated* across the TP group: identical on every TP rank. The global gradient norm
must sum a TP-sharded parameter's squares over the TP group, but count a replicated one once.

On TP rank ``r`` of ``t`` a marked parameter holds the ``r``-th of ``t`` equal contiguous chunks of the full
tensor along its dimension: ``full_shape`` is the full tensor's shape, ``gather_tp_tensor`` its values (a
collective over the TP group).
"""

from __future__ import annotations

import torch

_TP_ATTR = "_hybrid_tensor_parallel"


def mark_tensor_parallel(param: torch.nn.Parameter, partition_dim: int) -> torch.nn.Parameter:
    """Record that ``param`` is sliced along ``partition_dim`` across the TP group (a negative dim counts
    from the end, as in torch, and is stored as the non-negative one)."""
    dim = int(partition_dim)
    if not -param.dim() <= dim < param.dim():
        raise ValueError(f"partition_dim {partition_dim} is not a dimension of a {param.dim()}-D parameter "
                         f"(shape {tuple(param.shape)})")
    setattr(param, _TP_ATTR, dim % param.dim())
    return param


def is_tensor_parallel(param: torch.Tensor) -> bool:
    return getattr(param, _TP_ATTR, None) is not None


def tensor_parallel_dim(param: torch.Tensor):
    """The dimension ``param`` is sliced along across TP ranks, or None for a replicated parameter."""
    return getattr(param, _TP_ATTR, None)


def full_shape(param: torch.Tensor, tp: int) -> torch.Size:
    """The single-process shape of a (possibly TP-sliced) parameter on a TP group of ``tp`` ranks."""
    dim = tensor_parallel_dim(param)
    shape = list(param.shape)
    if dim is not None:
        shape[dim] *= tp
    return torch.Size(shape)


def gather_tp_tensor(local: torch.Tensor, dim: int, comm) -> torch.Tensor:
    """The full tensor from every TP rank's slice ``local`` along ``dim``: an all-gather over ``comm`` (a
    ``hybrid.comm.Comm`` of the TP group; None or a group of one: a copy of ``local``), on every TP rank."""
    if comm is None or comm.solo:
        return local.clone()
    local = local.contiguous()
    flat = torch.empty(comm.size * local.numel(), dtype=local.dtype, device=local.device)
    comm.all_gather(flat, local.view(-1))
    return torch.cat(flat.view(comm.size, *local.shape).unbind(0), dim=dim)
