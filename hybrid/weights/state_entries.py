"""What a module's ``state_dict()`` holds, walked without calling it.

``state_dict_entries(module)`` yields ``(name, kind, value)`` for every key ``module.state_dict()`` would
have, in its order: parameters (``PARAM``), persistent buffers (``BUFFER``) and ``get_extra_state()``
(``EXTRA``), a shared module or tied tensor under each of its names. The first name of a tensor is the one
``named_parameters()`` gives it. Walking the modules instead of calling ``state_dict()`` lets the ZeRO
engine read the tensors while stage 3 has released its parameters (it refuses ``state_dict()`` then), and
gives the engine's ``full_state_dict`` and the sharded checkpoint one notion of a module's state.
``exported(tensor)`` is the dtype such a full state dict gives a frozen parameter or a buffer.
"""

from __future__ import annotations

from typing import Any, Iterator

import torch
from torch import nn

PARAM, BUFFER, EXTRA = "parameter", "buffer", "extra state"


def state_dict_entries(module: nn.Module, extra: bool = True) -> Iterator[tuple[str, str, Any]]:
    """See the module docstring; ``extra=False`` leaves out the extra state (``get_extra_state()`` is not
    called: it may serialise)."""
    for prefix, mod in module.named_modules(remove_duplicate=False):
        dot = f"{prefix}." if prefix else ""
        for name, p in mod._parameters.items():
            if p is not None:
                yield dot + name, PARAM, p
        for name, b in mod._buffers.items():
            if b is not None and name not in mod._non_persistent_buffers_set:
                yield dot + name, BUFFER, b
        if extra and type(mod).get_extra_state is not nn.Module.get_extra_state:
            yield dot + "_extra_state", EXTRA, mod.get_extra_state()  # torch's key for it


def exported(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` as a full state dict holds it: floating point at least fp32 (bf16 and fp16 upcast, as the
    parameters' fp32 masters are; fp64 kept, never rounded), integers and booleans as they are."""
    return tensor.to(torch.promote_types(tensor.dtype, torch.float32)) if tensor.is_floating_point() else tensor
