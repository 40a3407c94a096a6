"""hybrid: tensor parallelism inside a node, ZeRO data parallelism across nodes.

The library that runs inside one rank. It imports torch, never Ray.
"""

__version__ = "0.1.0"


def initialize(model, config, dp_group=None, tp_group=None, **kwargs):
    """``hybrid.zero.initialize``: wrap ``model`` (ordinary or built on the meta device) in the ZeRO engine;
    keyword arguments ``seed``, ``init_fn``, ``weights``, ``device`` (imported lazily, so ``import hybrid``
    stays light for the launcher)."""
    from hybrid.zero import initialize as _initialize

    return _initialize(model, config, dp_group=dp_group, tp_group=tp_group, **kwargs)


def materialize(model, seed=0, **kwargs):
    """``hybrid.materialize.materialize``: give a meta-built model the values ``initialize`` would, in one
    process (keyword arguments ``init_fn``, ``weights``, ``device``, ``tp_rank``, ``tp``)."""
    from hybrid.value_sources import materialize as _materialize

    return _materialize(model, seed, **kwargs)


def __getattr__(name):
    if name in ("TrainConfig", "ZeroConfig", "OptimizerConfig"):
        import hybrid.config

        return getattr(hybrid.config, name)
    raise AttributeError(f"module 'hybrid' has no attribute {name!r}")
