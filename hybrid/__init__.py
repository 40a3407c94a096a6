"""hybrid: tensor parallelism inside a node, ZeRO data parallelism across nodes.

The library that runs inside one rank. It imports torch, never Ray.
"""

__version__ = "0.1.0"


def initialize(model, config, dp_group=None, tp_group=None):
    """``hybrid.zero.initialize``: wrap ``model`` in the ZeRO engine (imported lazily, so ``import hybrid``
    stays light for the launcher)."""
    from hybrid.zero import initialize as _initialize

    return _initialize(model, config, dp_group=dp_group, tp_group=tp_group)


def __getattr__(name):
    if name in ("TrainConfig", "ZeroConfig", "OptimizerConfig"):
        import hybrid.config

        return getattr(hybrid.config, name)
    raise AttributeError(f"module 'hybrid' has no attribute {name!r}")
