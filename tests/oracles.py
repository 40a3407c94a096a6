"""The built-in GPT's analytic formulas: the tests' oracle for the profile path the product takes.

The plan measures every model's activations, FLOPs and eager ops from the model itself
(``hybrid.plan.profile``; the built-in GPT through ``launch.planning.model_size.gpt_figures``). These closed forms
of the GPT -- Korthikanti et al.'s activation accounting as the GPT's own kernels keep it, and ``6·Ψ + 12·L·h·s``
FLOPs per token (``gpt_model_shape``: the time model's analytic branch) -- are what the profile is checked against
(tests/unit/test_profile_planning.py, tests/unit/test_cost_model.py), not what the product computes.
"""

from __future__ import annotations

from fractions import Fraction

from hybrid.config import validate as v
from hybrid.config.validate import DEFAULT_PRECISION, PRECISIONS
from hybrid.plan.cost import ModelShape
from hybrid.plan.memory import DTYPE_BYTES, FP32, _positive_int


def gpt_model_shape(params: int, shape: dict) -> ModelShape:
    """The time model's analytic shape of the built-in GPT of config dict ``shape`` (``GPTConfig.to_dict()``)."""
    return ModelShape(params, shape["n_layers"], shape["hidden"], shape["n_heads"], shape["seq_len"],
                      shape["vocab_size"], shape.get("mlp_ratio", 4))


def gpt_activation_bytes(seq: int, micro_batch: int, hidden: int, heads: int, layers: int, vocab: int,
                         tp: int = 1, precision: str = DEFAULT_PRECISION, mlp_ratio: int = 4,
                         checkpointing: bool = False) -> int:
    """Activation bytes of the built-in GPT at the start of backward (its peak), for one micro-batch.

    Per layer, in the model dtype, with x = s·b·h elements (SDPA keeps no s×s scores, only its output and
    a fp32 log-sum-exp per head and token): the block input and the LN1 output, the fused QKV output (3x/t),
    SDPA's contiguous q, k, v (3x/t), the attention output and its contiguous copy (2x/t), the residual sum and the LN2 output, the MLP
    up-projection and its GELU (2·mlp_ratio·x/t); plus the fp32 LayerNorm statistics. With activation
    checkpointing only each layer's input is kept, and one layer is recomputed at a time. On top: the
    final LayerNorm's input and output, and the loss: ``hybrid.tp.loss`` keeps one fp32 copy of the
    s·b·vocab/t logits (the softmax, turned into the gradient in place), beside the model-dtype logits at the
    end of the forward (or their gradient's cast at the start of backward).
    """
    s, b, h = (_positive_int(x, name) for x, name in ((seq, "seq"), (micro_batch, "micro_batch"), (hidden, "hidden")))
    a, n, t = _positive_int(heads, "heads"), _positive_int(layers, "layers"), _positive_int(tp, "tp")
    vocab = _positive_int(vocab, "vocab")
    item = DTYPE_BYTES[v.one_of("precision", precision, PRECISIONS)]
    x = s * b * h
    # (8 + 2r)x/t: SDPA's CPU flash kernel and the efficient CUDA kernel keep contiguous q, k, v too.
    per_layer = item * (4 * x + Fraction((8 + 2 * mlp_ratio) * x, t)) + FP32 * s * b * (4 + Fraction(a, t))
    per_layer = int(per_layer)
    layer_stack = (n * item * x + per_layer) if checkpointing else n * per_layer
    final = 2 * item * x
    logits = s * b * Fraction(vocab, t)
    loss = int(logits * (FP32 + item))
    return int(layer_stack + final + loss)
