"""``GPTConfig``: the shape of the built-in GPT, validated on construction.

A model YAML keeps these keys under a ``model:`` mapping so other sections (``train:`` …) can sit beside
it::

    model: {vocab_size: 256, seq_len: 32, n_layers: 2, hidden: 64, n_heads: 4}

``activation_checkpointing: true`` keeps only each transformer block's input in forward and recomputes
the block in backward (``torch.utils.checkpoint``, non-reentrant): same results, less activation memory.

``GPTConfig`` is a schema (``hybrid.config.schema``; the ``train:`` mapping beside it, ``hybrid.models.sections``):
each field's default, check and help is declared once. Every invalid field raises ``ConfigError`` with one
sentence naming ``model.<field>`` and the fix. ``check_tp(tp)`` says whether a tensor-parallel degree can
split this model (heads, vocabulary and MLP width must divide evenly; dropout needs tp=1); it is pure, so the
planner and launcher can call it before any rank starts.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import partial
from typing import Any, Mapping

from hybrid.config import validate as v
from hybrid.config.schema import Section, Where, read, setting
from hybrid.errors import ConfigError
from hybrid.config.yamlfile import load_yaml

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


_COUNT = v.positive_int
_REAL = v.positive_number


@dataclass(frozen=True)
class GPTConfig(Section):
    SECTION = "model"

    vocab_size: int = setting(check=_COUNT, help="tokens in the vocabulary (at least the data file's)")
    seq_len: int = setting(check=_COUNT, help="tokens per training sequence (and positions)")
    n_layers: int = setting(check=partial(v.positive_int, hi=MAX_LAYERS), help="transformer blocks")
    hidden: int = setting(check=_COUNT, help="the model width")
    n_heads: int = setting(check=_COUNT, help="attention heads; must divide hidden")
    mlp_ratio: int = setting(4, _COUNT, help="the MLP width as a multiple of hidden")
    dropout: float = setting(0.0, partial(v.number, lo=0, hi=1, hi_open=True, need="a number in [0, 1)"),
                             yaml_number=True, help="dropout probability (needs tp=1)")
    bias: bool = setting(True, v.boolean, help="biases in the linear layers and norms")
    layer_norm_eps: float = setting(1e-5, _REAL, yaml_number=True, help="LayerNorm epsilon")
    init_std: float = setting(0.02, _REAL, yaml_number=True, help="standard deviation of the initial weights")
    activation_checkpointing: bool = setting(False, v.boolean,
                                             help="recompute each block's activations in backward")

    def _check_together(self, where: Where) -> None:
        if shape_violation(self.hidden, self.n_heads):
            raise ConfigError(f"{where('n_heads')}={self.n_heads} does not divide {where('hidden')}={self.hidden}; "
                              f"choose n_heads so that hidden is a multiple of it.")

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
        """The ``model:`` mapping of a model config (numbers YAML read as strings, ``1e-6``, taken as numbers)."""
        return read(cls, d, "model", need="under the model: mapping")

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

