"""``empty_init()``: build a model whose parameters are on the meta device and whose buffers are computed.

Under ``torch.device("meta")`` every tensor a constructor makes is on meta, buffers too: a rotary table
(``inv_freq``) computed in ``__init__`` and kept out of the weights file then has no values anywhere, and
``hybrid.initialize`` refuses it (``hybrid.weights.sources``). Under ``empty_init()`` each parameter is moved to
meta as it is registered (what accelerate's ``init_empty_weights`` does), before the module's own
``reset_parameters`` runs on it, so initializing costs nothing, while buffers are computed as usual on the
default device. The parameters then get their values from ``hybrid.initialize`` / ``hybrid.materialize``
(``weights=``, an initializer, or the module's own init and ``init_fn``), only where a rank keeps them.

A parameter made with values (``nn.Parameter(torch.ones(n))``) is computed, then dropped; one made with
``torch.empty`` (``nn.Linear``, ``nn.Embedding``) is never touched. A small one (at most ``KEPT_ELEMENTS``: a
norm's scale, an activation's learnable scalars) keeps what its constructor computed, on the CPU, beside the
meta parameter (``constructed_values``): what ``hybrid.initialize`` gives it when no init writes it, as an
ordinary build would have it. ``nn.Module.register_parameter`` is patched
for the block in this process (every thread), and put back when it ends.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch import nn


KEPT_ELEMENTS = 1 << 16  # the largest parameter whose constructed values are kept (256 KiB in fp32)
_CONSTRUCTED = "_hybrid_constructed"


def _on_meta(param: nn.Parameter) -> nn.Parameter:
    """``param`` on the meta device: the same class, ``requires_grad`` and attributes (and, when small, what
    its constructor computed)."""
    meta = torch.empty_like(param, device="meta")
    moved = nn.Parameter(meta, param.requires_grad) if type(param) is nn.Parameter else \
        type(param)(meta, requires_grad=param.requires_grad)
    moved.__dict__.update(param.__dict__)
    if param.numel() <= KEPT_ELEMENTS:
        setattr(moved, _CONSTRUCTED, param.detach().to("cpu", copy=True))
    return moved


def constructed_values(param: torch.Tensor):
    """What the constructor computed for a parameter ``empty_init`` moved to meta (small ones only), or None."""
    return getattr(param, _CONSTRUCTED, None)


@contextlib.contextmanager
def empty_init() -> Iterator[None]:
    """Parameters registered inside the block go to the meta device; buffers keep their values."""
    original = nn.Module.register_parameter

    def register_parameter(module: nn.Module, name: str, param) -> None:
        original(module, name, param)
        if param is not None and not param.is_meta:
            module._parameters[name] = _on_meta(module._parameters[name])

    nn.Module.register_parameter = register_parameter
    try:
        yield
    finally:
        nn.Module.register_parameter = original
