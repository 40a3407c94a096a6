"""The ZeRO engine on the data-parallel group: ``initialize(model, config, dp_group=None, tp_group=None)``.

See ``engine.py`` for the semantics, and the sibling modules for the pieces each stage is built from.
"""

from __future__ import annotations

from hybrid.config import TrainConfig
from hybrid.zero.engine import ShardView, ZeroEngine

__all__ = ["initialize", "ShardView", "ZeroEngine"]


def initialize(model, config, dp_group=None, tp_group=None) -> ZeroEngine:
    """Wrap ``model`` in a ZeroEngine; ``config`` is a ``TrainConfig`` or a dict (ours or DeepSpeed-style)."""
    if not isinstance(config, TrainConfig):
        config = TrainConfig.from_dict(config)
    return ZeroEngine(model, config, dp_group=dp_group, tp_group=tp_group)
