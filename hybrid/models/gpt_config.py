"""``GPTConfig``: the shape of the built-in GPT, validated on construction.

A model YAML keeps these keys under a ``model:`` mapping so other sections (``train:`` …) can sit beside
it::

    model: {vocab_size: 256, seq_len: 32, n_layers: 2, hidden: 64, n_heads: 4}

Every invalid field raises ``ConfigError`` with one sentence naming ``model.<field>`` and the fix.
``check_tp(tp)`` says whether a tensor-parallel degree can split this model (heads, vocabulary and MLP
width must divide evenly; dropout needs tp=1); it is pure, so the planner and launcher can call it before any rank starts.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import yaml

from hybrid.errors import ConfigError


_FLOAT_FIELDS = ("dropout", "layer_norm_eps", "init_std")


def _yaml_float(value):
    # PyYAML reads "1e-5" (no dot) as a string; accept it as the number it plainly is.
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return value
    return value


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int
    seq_len: int
    n_layers: int
    hidden: int
    n_heads: int
    mlp_ratio: int = 4
    dropout: float = 0.0
    bias: bool = True
    layer_norm_eps: float = 1e-5
    init_std: float = 0.02

    def __post_init__(self):
        for name in ("vocab_size", "seq_len", "n_layers", "hidden", "n_heads", "mlp_ratio"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"model.{name} must be a positive integer, got {value!r}.")
        if self.hidden % self.n_heads:
            raise ConfigError(f"model.n_heads={self.n_heads} does not divide model.hidden={self.hidden}; "
                              f"choose n_heads so that hidden is a multiple of it.")
        if not isinstance(self.dropout, (int, float)) or isinstance(self.dropout, bool) \
                or not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"model.dropout must be a number in [0, 1), got {self.dropout!r}.")
        if not isinstance(self.bias, bool):
            raise ConfigError(f"model.bias must be true or false, got {self.bias!r}.")
        for name in ("layer_norm_eps", "init_std"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"model.{name} must be a positive number, got {value!r}.")

    @property
    def head_dim(self) -> int:
        return self.hidden // self.n_heads

    @property
    def ffn_hidden(self) -> int:
        return self.mlp_ratio * self.hidden

    def check_tp(self, tp: int) -> None:
        """Raise ConfigError unless tensor-parallel degree ``tp`` can split this model."""
        for field, n in (("n_heads", self.n_heads), ("vocab_size", self.vocab_size),
                         ("mlp_ratio*hidden", self.ffn_hidden)):
            if n % tp:
                raise ConfigError(f"model.{field}={n} is not divisible by the tensor-parallel degree tp={tp}; "
                                  f"choose a tp that divides {n} or change model.{field}.")
        if self.dropout and tp > 1:
            # Replicated activations would need the same dropout mask on every TP rank, and the TP layers
            # keep no shared RNG stream for that.
            raise ConfigError(f"model.dropout={self.dropout} is not supported with tensor parallelism (tp={tp}); "
                              f"set model.dropout to 0 or use tp=1.")

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "GPTConfig":
        if not isinstance(d, Mapping):
            raise ConfigError(f"model must be a mapping of model keys, got {type(d).__name__}.")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ConfigError(f"model.{unknown[0]} is not a GPT model key; use only {', '.join(sorted(known))}.")
        missing = [f.name for f in dataclasses.fields(cls)
                   if f.default is dataclasses.MISSING and f.name not in d]
        if missing:
            raise ConfigError(f"model.{missing[0]} is missing; add it under the model: mapping.")
        return cls(**{k: _yaml_float(v) if k in _FLOAT_FIELDS else v for k, v in d.items()})

    @classmethod
    def from_yaml(cls, path) -> "GPTConfig":
        """Read the ``model:`` mapping of a YAML file."""
        path = Path(path)
        try:
            doc = yaml.safe_load(path.read_text())
        except OSError as exc:
            raise ConfigError(f"cannot read model config {path}: {exc.strerror}; check the path.") from exc
        except yaml.YAMLError as exc:
            raise ConfigError(f"{path} is not valid YAML ({exc}); fix the syntax.") from exc
        if not isinstance(doc, Mapping) or "model" not in doc:
            raise ConfigError(f"{path} has no model: mapping; put vocab_size, seq_len, n_layers, hidden and "
                              f"n_heads under model:.")
        return cls.from_dict(doc["model"])

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)
