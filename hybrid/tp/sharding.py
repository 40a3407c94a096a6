"""How TP-sliced parameters relate to the full (single-process) ones.

A parameter marked with ``hybrid.weights.attrs.mark_tensor_parallel(p, dim)`` holds, on TP rank ``r`` of
``t``, the ``r``-th of ``t`` equal contiguous chunks of the full tensor along ``dim``. Everything here is
that one rule: slicing a full tensor, the full shape of a slice, gathering slices back (checkpoints,
tests), and the seeded initialization (``init_param_``, from ``hybrid.weights.init``) that makes a TP model
built with seed S hold exactly the slices of the single-process model built with seed S.
"""

from __future__ import annotations

from typing import Mapping, Optional

import torch

from hybrid.comm.collectives import Comm
from hybrid.errors import ConfigError
from hybrid.weights.attrs import full_shape, tensor_parallel_dim


def tp_rank_size(comm: Optional[Comm]) -> tuple[int, int]:
    """``(rank, size)`` in the TP group; ``(0, 1)`` without one."""
    return (0, 1) if comm is None else (comm.rank, comm.size)


def divide(n: int, tp: int, field: str) -> int:
    """``n // tp``, or a ConfigError naming ``field`` when tp does not divide it."""
    if n % tp:
        raise ConfigError(f"{field}={n} is not divisible by the tensor-parallel degree tp={tp}; "
                          f"choose a tp that divides {n}.")
    return n // tp


def tp_slice(full: torch.Tensor, dim: Optional[int], rank: int, tp: int) -> torch.Tensor:
    """Rank ``rank``'s chunk of ``full`` along ``dim`` (the whole tensor when ``dim`` is None)."""
    if dim is None or tp == 1:
        return full
    if full.shape[dim] % tp:
        raise ValueError(f"dimension {dim} of size {full.shape[dim]} does not split into {tp} TP slices")
    return full.chunk(tp, dim=dim)[rank]


def gather_tp_tensor(local: torch.Tensor, dim: int, comm: Optional[Comm]) -> torch.Tensor:
    """All-gather TP slices along ``dim`` into the full tensor (collective over the TP group)."""
    if comm is None or comm.solo:
        return local.clone()
    local = local.contiguous()
    flat = torch.empty(comm.size * local.numel(), dtype=local.dtype, device=local.device)
    comm.all_gather(flat, local.view(-1))
    return torch.cat(flat.view(comm.size, *local.shape).unbind(0), dim=dim)


def tp_dims(model: torch.nn.Module) -> dict[str, Optional[int]]:
    """Parameter name → TP slicing dim (None for replicated parameters)."""
    return {name: tensor_parallel_dim(p) for name, p in model.named_parameters()}


def gather_tp_state_dict(state: Mapping[str, torch.Tensor], model: torch.nn.Module,
                         tp_comm: Optional[Comm]) -> dict[str, torch.Tensor]:
    """Full tensors for a state dict of this TP rank's slices; every TP rank must call it.

    Names are ``model``'s parameter names; entries that are not TP-sliced parameters are copied as is.
    """
    dims = tp_dims(model)
    out = {}
    for name, tensor in state.items():
        tensor, dim = tensor.detach(), dims.get(name)
        out[name] = tensor.clone() if dim is None else gather_tp_tensor(tensor, dim, tp_comm)
    return out


def slice_tp_state_dict(state: Mapping[str, torch.Tensor], model: torch.nn.Module, tp_rank: int,
                        tp: int) -> dict[str, torch.Tensor]:
    """The TP rank's slices of a full (single-process) state dict, for loading into ``model``."""
    dims = tp_dims(model)
    return {name: tp_slice(t, dims.get(name), tp_rank, tp).clone() for name, t in state.items()}


@torch.no_grad()
def init_param_(param: torch.Tensor, seed: int, name: str, tp_rank: int, tp: int) -> None:
    """Fill ``param`` (this TP rank's slice) from its ``hybrid.weights.init`` initializer, seeded by ``seed`` and
    the initializer's key (``name`` when it has none): the slice of the same full tensor at every TP degree."""
    from hybrid.weights.init import get_initializer, local_values

    init = get_initializer(param)
    if init is None:
        raise ValueError(f"parameter {name!r} has no hybrid.weights.init initializer")
    values = local_values(init, seed, init.key or name, full_shape(param, tp), tensor_parallel_dim(param),
                          tp_rank, tp, 0, param.numel())
    param.copy_(values.view(param.shape))


@torch.no_grad()
def init_param_from_torch_rng_(param: torch.Tensor, tp_rank: int, tp: int) -> None:
    """Fill ``param`` (this TP rank's slice) with its slice of a full tensor drawn from its initializer with
    torch's default generator: every TP degree consumes the generator alike, so ranks seeded alike hold the
    slices of one full tensor."""
    from hybrid.weights.init import get_initializer

    shape = full_shape(param, tp)
    full = get_initializer(param).draw_chunk(shape.numel(), None).view(shape)
    param.copy_(tp_slice(full, tensor_parallel_dim(param), tp_rank, tp))
