"""Sharded construction: the model's values written straight into a rank's ``FlatState``, parameter by parameter.

``materialize(module, params, shapes, state, sources, device)`` walks the model's modules in order
(``hybrid.weights.sources``): each trainable parameter gets only the range of values this rank stores
(``FlatState.needed_range``: its owned range at stage 3, the whole parameter at stages 0-2), drawn or read
by its source and written where the rank keeps it; a frozen parameter or buffer that is on the meta
device (or comes from a weights file) is materialized whole on ``device``. Then every trainable
parameter is bound to its view of the flat buffers (``FlatState.bind_unit``); a meta parameter is
replaced, wherever the model registers it, by a real one that keeps its marks. The largest transient held
on the way (one parameter's values, one module's own init, one stage-3 unit buffer) is returned with the
per-unit views, so the engine can report its construction peak. ``params`` is updated in place.

``resolve_device`` picks where the states live for a model that may be entirely on meta.
"""

from __future__ import annotations

import os

import torch
from torch import nn

from hybrid.weights.sources import ValueSources, new_parameter, references, replace_tensor
from hybrid.zero.state import FlatState


def resolve_device(params: list, device=None) -> torch.device:
    """Where the model states live: ``device``, else the parameters' device, else (a meta-built model) the
    rank's CUDA device under NCCL, or the CPU."""
    if device is not None:
        return torch.device(device)
    devices = {p.device for p in params if not p.is_meta}
    if len(devices) > 1:
        raise ValueError("all trainable parameters must be on one device")
    if devices:
        return devices.pop()
    dist = torch.distributed
    if torch.cuda.is_available() and dist.is_initialized() and "nccl" in str(dist.get_backend()):
        bound = getattr(dist.group.WORLD, "bound_device_id", None)
        if bound is not None:
            return bound
        # Not bound (a plain init_process_group("nccl")): torchrun's LOCAL_RANK, not cuda:0 on every rank.
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", torch.cuda.current_device())))
    return torch.device("cpu")


@torch.no_grad()
def materialize(module: nn.Module, params: list, shapes: list, state: FlatState, sources: ValueSources,
                device: torch.device) -> tuple:
    """Fill ``state`` and bind ``params`` (see the module docstring); returns (per unit ``[(parameter,
    view)]``, the largest transient bytes held)."""
    refs = references(module)
    index = {id(p): i for i, p in enumerate(params)}
    largest = 0
    for group in sources.modules():
        for e in group.entries:
            i = index.get(id(e.tensor)) if e.is_param else None
            if i is not None:
                lo, hi = state.needed_range(i)
                if hi > lo:
                    values = group.values(e, lo, hi)
                    largest = max(largest, values.numel() * values.element_size())
                    state.write(i, lo, values)
            elif e.tensor.is_meta or (sources.weights is not None and e.persistent):
                data = group.values(e, 0, e.tensor.numel()).view(e.tensor.shape)
                data = data.to(device=device, dtype=e.tensor.dtype)
                replace_tensor(refs, e.tensor, new_parameter(e.tensor, data) if e.is_param else data)
        largest = max(largest, group.init_bytes)

    def bind(i: int, view: torch.Tensor) -> None:
        old = params[i]
        if old.is_meta:  # new_parameter binds through .data: the parameter keeps its own version counter
            new = new_parameter(old, view)
            replace_tensor(refs, old, new)
            params[i] = new
        else:
            old.data = view

    views = []
    for unit in state.layout.units:
        pairs = state.bind_unit(unit.index, shapes, bind)
        views.append([(params[i], view) for i, view in pairs])
        if state.policy.shard_params and unit.index not in state.persistent:
            largest = max(largest, unit.numel * state.dtype.itemsize)
    return views, largest
