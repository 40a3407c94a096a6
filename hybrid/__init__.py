"""hybrid: tensor parallelism inside a node, ZeRO data parallelism across nodes.

The library that runs inside one rank. It imports torch, never Ray; ``import hybrid`` itself imports
nothing heavy (the names below load on first use), so the launcher stays light. The packages, by what they are:

- ``config``: what a user writes, read and checked (training config, validation vocabulary, YAML, units).
- ``plan``: the memory model, the stage-selection planner, what a rank measures of its memory, NVML.
- ``comm``: the collectives (every one goes through ``Comm``), their transports, the dp x tp mesh.
- ``tp``: tensor-parallel layers, their autograd collectives, the vocab-parallel loss.
- ``zero``: the ZeRO engine, stages 0-3 as one policy table over shared pieces.
- ``weights``: where parameter values come from (initializers, weights files, per-module sources).
- ``checkpoint``: sharded, atomic, resharding checkpoints; offline consolidation.
- ``runtime``: what runs in a rank around the engine (the entrypoint's Context and loop, the local runner).
- ``data``: token files and synthetic streams; ``models``: the built-in GPT.
- ``errors``: the error types every part raises, and what each means for the job.

Modules that moved when the folders were introduced still import under their old names
(``hybrid.memory`` is ``hybrid.plan.memory``; see ``MOVED``), so user code and old pickles keep working.
"""

import importlib
import importlib.abc
import importlib.util
import sys

__version__ = "0.1.0"

# Old module name -> where it lives now.
MOVED = {
    'hybrid.buffer_pool': 'hybrid.comm.buffer_pool',
    'hybrid.shm_collectives': 'hybrid.comm.shm',
    'hybrid.heartbeat': 'hybrid.comm.heartbeat',
    'hybrid.mesh': 'hybrid.comm.mesh',
    'hybrid.validate': 'hybrid.config.validate',
    'hybrid.yamlfile': 'hybrid.config.yamlfile',
    'hybrid.units': 'hybrid.config.units',
    'hybrid.schedule': 'hybrid.config.schedule',
    'hybrid.zero.policy': 'hybrid.config.stage_policy',
    'hybrid.zero.partition': 'hybrid.plan.layout',
    'hybrid.memory_budget': 'hybrid.plan.budget',
    'hybrid.memory': 'hybrid.plan.memory',
    'hybrid.planner': 'hybrid.plan.planner',
    'hybrid.monitor': 'hybrid.plan.monitor',
    'hybrid.cpu_bf16': 'hybrid.plan.cpu_bf16',
    'hybrid.train': 'hybrid.runtime.train',
    'hybrid.local_launch': 'hybrid.runtime.local_launch',
    'hybrid.value_sources': 'hybrid.weights.sources',
    'hybrid.param_init': 'hybrid.weights.init',
    'hybrid.param_attrs': 'hybrid.weights.attrs',
    'hybrid.state_entries': 'hybrid.weights.state_entries',
    'hybrid.models.gpt_config': 'hybrid.models.gpt.config',
    'hybrid.models.gpt_train': 'hybrid.models.gpt.training',
}


class _MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports a moved module's old name as the module itself (one module object under both names)."""

    def __init__(self) -> None:
        self.table: dict = {}

    def find_spec(self, name, path=None, target=None):
        return importlib.util.spec_from_loader(name, self) if name in self.table else None

    def create_module(self, spec):
        return importlib.import_module(self.table[spec.name])

    def exec_module(self, module) -> None:
        pass


_FINDER = _MovedModules()
sys.meta_path.insert(0, _FINDER)  # before any other finder: an old name means the moved module


def register_moved(table: dict) -> None:
    """Let the old names in ``table`` (old module -> new module) import the moved modules."""
    _FINDER.table.update(table)


register_moved(MOVED)


def initialize(model, config, dp_group=None, tp_group=None, **kwargs):
    """``hybrid.zero.initialize``: wrap ``model`` (ordinary or built on the meta device) in the ZeRO engine;
    keyword arguments ``seed``, ``init_fn``, ``weights``, ``device``."""
    from hybrid.zero import initialize as _initialize

    return _initialize(model, config, dp_group=dp_group, tp_group=tp_group, **kwargs)


def materialize(model, seed=0, **kwargs):
    """``hybrid.weights.sources.materialize``: give a meta-built model the values ``initialize`` would, in one
    process (keyword arguments ``init_fn``, ``weights``, ``device``, ``tp_rank``, ``tp``)."""
    from hybrid.weights.sources import materialize as _materialize

    return _materialize(model, seed, **kwargs)


def empty_init():
    """``hybrid.weights.empty.empty_init``: a context manager under which a model is built with its parameters on
    the meta device (nothing allocated) and its buffers computed as usual (a rotary table); then
    ``initialize`` / ``materialize`` give the parameters their values."""
    from hybrid.weights.empty import empty_init as _empty_init

    return _empty_init()


def __getattr__(name):
    if name in ("TrainConfig", "ZeroConfig", "OptimizerConfig"):
        import hybrid.config

        return getattr(hybrid.config, name)
    raise AttributeError(f"module 'hybrid' has no attribute {name!r}")
