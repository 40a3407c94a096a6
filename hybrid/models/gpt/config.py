"""``GPTConfig``: the shape of the built-in GPT, validated on construction.

A model YAML keeps these keys under a ``model:`` mapping so other sections (``train:`` …) can sit beside
it::

    model: {vocab_size: 256, seq_len: 32, n_layers: 2, hidden: 64, n_heads: 4}

``activation_checkpointing: true`` keeps only each transformer block's input in forward and recomputes
the block in backward (``torch.utils.checkpoint``, non-reentrant): same results, less activation memory.

Every invalid field raises ``ConfigError`` with one sentence naming ``model.<field>`` and the fix.
``check_tp(tp)`` says whether a tensor-parallel degree can split this model (heads, vocabulary and MLP
width must divide evenly; dropout needs tp=1); it is pure, so the planner and launcher can call it before any rank starts.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping

from hybrid.config import validate as v
from hybrid.errors import ConfigError
from hybrid.config.yamlfile import load_yaml


_FLOAT_FIELDS = ("dropout", "layer_norm_eps", "init_std")
# 30x the deepest published transformers (~128 blocks): a bound that only catches typos, which would
# otherwise keep the planner building the model on the meta device for minutes.
MAX_LAYERS = 4096


def shape_violation(hidden: int, n_heads: int, tp: int = 1, vocab_size=None, ffn_hidden=None):
    """The first of the GPT's shape rules that these sizes break, as ``(field, n, divisor)`` (``field`` is
    ``"hidden"``, ``"n_heads"``, ``"vocab_size"`` or ``"mlp_ratio*hidden"``: ``n`` must be a multiple of
    ``divisor``), or None: heads divide hidden, and tp divides the heads, the vocabulary and the MLP width
    (each unless None). One rule for ``GPTConfig`` and for the estimate CLI, which says it in its options."""
    if hidden % n_heads:
        return "hidden", hidden, n_heads
    for field, n in (("n_heads", n_heads), ("vocab_size", vocab_size), ("mlp_ratio*hidden", ffn_hidden)):
        if n is not None and n % tp:
            return field, n, tp
    return None


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
    activation_checkpointing: bool = False  # recompute each block's activations in backward

    def __post_init__(self):
        for name in ("vocab_size", "seq_len", "n_layers", "hidden", "n_heads", "mlp_ratio"):
            v.positive_int(f"model.{name}", getattr(self, name), hi=MAX_LAYERS if name == "n_layers" else None)
        if shape_violation(self.hidden, self.n_heads):
            raise ConfigError(f"model.n_heads={self.n_heads} does not divide model.hidden={self.hidden}; "
                              f"choose n_heads so that hidden is a multiple of it.")
        dropout = v.number("model.dropout", self.dropout, 0, 1, need="a number in [0, 1)")
        if dropout == 1:
            raise v.invalid("model.dropout", "a number in [0, 1)", self.dropout)
        v.boolean("model.bias", self.bias)
        v.boolean("model.activation_checkpointing", self.activation_checkpointing)
        for name in ("layer_norm_eps", "init_std"):
            v.positive_number(f"model.{name}", getattr(self, name))

    @property
    def head_dim(self) -> int:
        return self.hidden // self.n_heads

    @property
    def ffn_hidden(self) -> int:
        return self.mlp_ratio * self.hidden

    def check_tp(self, tp: int) -> None:
        """Raise ConfigError unless tensor-parallel degree ``tp`` can split this model."""
        broken = shape_violation(self.hidden, self.n_heads, tp, self.vocab_size, self.ffn_hidden)
        if broken is not None:
            field, n, _ = broken
            raise ConfigError(f"model.{field}={n} is not divisible by the tensor-parallel degree tp={tp}; "
                              f"choose a tp that divides {n} or change model.{field}.")
        if self.dropout and tp > 1:
            # Replicated activations would need the same dropout mask on every TP rank, and the TP layers
            # keep no shared RNG stream for that.
            raise ConfigError(f"model.dropout={self.dropout} is not supported with tensor parallelism (tp={tp}); "
                              f"set model.dropout to 0 or use tp=1.")

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "GPTConfig":
        d = v.mapping("model", d, [f.name for f in dataclasses.fields(cls)])
        for f in dataclasses.fields(cls):
            if f.default is dataclasses.MISSING:
                v.required(d, "model", f.name, "under the model: mapping")
        return cls(**{k: v.yaml_number(x) if k in _FLOAT_FIELDS else x for k, x in d.items()})

    @classmethod
    def from_yaml(cls, path) -> "GPTConfig":
        """Read the ``model:`` mapping of a YAML file."""
        doc = load_yaml(path, "model config")
        if not isinstance(doc, Mapping) or "model" not in doc:
            raise ConfigError(f"model config {v.quote(str(path))} has no model: mapping; put vocab_size, seq_len, "
                              "n_layers, hidden and n_heads under model:.")
        return cls.from_dict(doc["model"])

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)
