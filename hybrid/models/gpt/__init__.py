"""The built-in tensor-parallel GPT: ``model`` (the module), ``config`` (its shape), ``training`` (the built-in
entrypoint ``hybrid.models.gpt:train`` and the pieces an own loop reuses)."""

import importlib

_WHERE = {"GPT": "model", "count_parameters": "model", "GPTConfig": "config", "train": "training"}

__all__ = sorted(_WHERE)


def __getattr__(name: str):
    # Imported on first use: the launcher reads GPTConfig without building anything.
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'hybrid.models.gpt' has no attribute {name!r}")
    return getattr(importlib.import_module(f"hybrid.models.gpt.{module}"), name)
