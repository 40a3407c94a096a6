"""The ZeRO engine on the data-parallel group: ``initialize(model, config, dp_group=None, tp_group=None)``.

See ``engine.py`` for the semantics, and the sibling modules for the pieces each stage is built from.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from hybrid.config.training import TrainConfig
from hybrid.errors import ConfigError, first_line
from hybrid.config.yamlfile import load_yaml, read_regular_file

__all__ = ["initialize", "config_file", "ShardView", "ZeroEngine"]


def config_file(path) -> dict:
    """The config dict in the JSON (``.json``) or YAML file ``path``; ``ConfigError`` (one sentence) when it
    cannot be read or parsed."""
    path = Path(path)
    if path.suffix.lower() != ".json":
        return load_yaml(path, "config file")
    raw = read_regular_file(path, f"config file {str(path)!r}", "pass the path of a JSON or YAML config file")
    try:
        return json.loads(raw.decode("utf-8-sig"))
    except (UnicodeDecodeError, RecursionError, ValueError) as err:
        raise ConfigError(f"config file {str(path)!r} is not valid JSON ({first_line(err)}); fix it there.") from None


def initialize(model, config, dp_group=None, tp_group=None, *, seed: int = 0, init_fn=None, weights=None,
               device=None) -> ZeroEngine:
    """Wrap ``model`` in a ZeroEngine; ``config`` is a ``TrainConfig``, a dict (ours or DeepSpeed-style) or the
    path of a JSON or YAML file holding one (``config_file``).

    ``model`` may be built on the meta device: it is then materialized unit by unit straight into this
    rank's shard, with values from ``seed`` and the parameter names (``hybrid.materialize``; ``init_fn``
    for modules without an initializer of their own), or streamed from ``weights`` (a consolidated ``.pt``
    or ``.safetensors`` file, or a Hugging Face ``save_pretrained`` directory; names and shapes are checked
    first). ``device``: where the states live
    (default: the parameters' device; for a meta model the rank's CUDA device under NCCL, else the CPU).
    """
    from hybrid.zero.engine import ZeroEngine

    if isinstance(config, (str, os.PathLike)):  # as deepspeed.initialize(config="ds_config.json") takes it
        config = config_file(config)
    if not isinstance(config, TrainConfig):
        config = TrainConfig.from_dict(config)
    return ZeroEngine(model, config, dp_group=dp_group, tp_group=tp_group, seed=seed, init_fn=init_fn,
                      weights=weights, device=device)


def __getattr__(name: str):
    # The engine (torch) loads on first use: the planner and the config read the pure modules beside it.
    if name in ("ShardView", "ZeroEngine"):
        from hybrid.zero import engine

        return getattr(engine, name)
    raise AttributeError(f"module 'hybrid.zero' has no attribute {name!r}")
