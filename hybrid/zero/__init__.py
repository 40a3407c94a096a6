"""The ZeRO engine on the data-parallel group: ``initialize(model, config, dp_group=None, tp_group=None)``.

See ``engine.py`` for the semantics, and the sibling modules for the pieces each stage is built from.
"""

from __future__ import annotations

from hybrid.config import TrainConfig
from hybrid.zero.engine import ShardView, ZeroEngine

__all__ = ["initialize", "ShardView", "ZeroEngine"]


def initialize(model, config, dp_group=None, tp_group=None, *, seed: int = 0, init_fn=None, weights=None,
               device=None) -> ZeroEngine:
    """Wrap ``model`` in a ZeroEngine; ``config`` is a ``TrainConfig`` or a dict (ours or DeepSpeed-style).

    ``model`` may be built on the meta device: it is then materialized unit by unit straight into this
    rank's shard, with values from ``seed`` and the parameter names (``hybrid.materialize``; ``init_fn``
    for modules without an initializer of their own), or streamed from ``weights`` (a consolidated ``.pt``
    or ``.safetensors`` file; names and shapes are checked first). ``device``: where the states live
    (default: the parameters' device; for a meta model the rank's CUDA device under NCCL, else the CPU).
    """
    if not isinstance(config, TrainConfig):
        config = TrainConfig.from_dict(config)
    return ZeroEngine(model, config, dp_group=dp_group, tp_group=tp_group, seed=seed, init_fn=init_fn,
                      weights=weights, device=device)
