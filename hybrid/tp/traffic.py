"""The TP collectives a split module makes per micro-step, counted from its split modules' styles.

``block_collectives(block)`` walks one block of a model split by ``hybrid.tp.apply_plan`` or built of
``hybrid.tp.layers`` (at any TP degree, TP 1 included: the modules already are their styles' classes) and counts,
per forward and backward of one micro-step, the all-reduces each style's forward (``hybrid.tp.styles``) makes:

- ``colwise`` (and ``colwise_rep``), a ``ColumnParallelLinear``: the input enters the TP region, so its gradient is
  summed in backward (one call of ``in_features`` per token); ``colwise_rep`` (``gather_output``) also gathers its
  output in forward (``out_features``);
- ``mla_kv_a_proj``: its rotary features' gradient in backward (``rope_dim``);
- ``rowwise`` / ``rowwise_rep``, a ``RowParallelLinear``: the output's partial sums, in forward
  (``out_features``); ``local_rowwise`` none;
- ``all_reduce``: its output in forward (counted at the block's residual width, ``width``);
- ``replicate_grad``: each of its parameters' gradients in backward (latency only: not per token).

``with_block_collectives(profile, model)`` adds the count to a model's profile (``ModelProfile.tp_block``: the
profile runs the model at TP 1, where no collective is called, so the count comes from the modules), and the time model
(``hybrid.plan.cost.tp_traffic``) prices it: the built-in GPT's block makes 2 calls in forward and 2 in backward; a
plan that splits q, k and v (or gate and up) one module at a time makes more: a Llama block 2 and 5.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict

from torch import nn

from hybrid.plan.cost import TpCalls
from hybrid.tp import layers, styles


def _calls(module: nn.Module, width: int):
    """``(style, forward calls, backward calls, forward width, backward width)`` of one module, or None."""
    if isinstance(module, (styles.ColwiseLinear, layers.ColumnParallelLinear)):
        gathered = isinstance(module, styles.ColwiseGatheredLinear) or getattr(module, "gather_output", False)
        return ("colwise_rep" if gathered else "colwise", int(gathered), 1,
                module.out_features if gathered else 0, module.in_features)
    if isinstance(module, styles.MlaKvAProjLinear):
        return "mla_kv_a_proj", 0, 1, 0, module.rope_dim
    if isinstance(module, styles.LocalRowwiseLinear):
        return None
    if isinstance(module, (styles.RowwiseLinear, layers.RowParallelLinear)):
        return "rowwise", 1, 0, module.out_features, 0
    if isinstance(module, styles.AllReduceOutput):
        return "all_reduce", 1, 0, width, 0
    if isinstance(module, styles.GradSummedReplica):
        return "replicate_grad", 0, sum(1 for _ in module.parameters(recurse=False)), 0, 0
    return None


def block_collectives(block: nn.Module, width: int) -> TpCalls:
    """The TP calls of one micro-step of ``block`` (see the module docstring); ``width``: the residual stream's
    features per token, for an ``all_reduce`` module whose output width is not its own attribute."""
    totals = [0, 0, 0, 0]
    by_style = defaultdict(lambda: [0, 0, 0])
    for module in block.modules():
        calls = _calls(module, width)
        if calls is None:
            continue
        style, *counts = calls
        totals = [a + b for a, b in zip(totals, counts)]
        tally = by_style[style]
        tally[0], tally[1], tally[2] = tally[0] + counts[0], tally[1] + counts[1], tally[2] + counts[2] + counts[3]
    return TpCalls(*totals, by_style=tuple((style, *tally) for style, tally in sorted(by_style.items())))


def with_block_collectives(profile, model: nn.Module):
    """``profile`` (a ``hybrid.plan.profile.ModelProfile``) with the TP calls of one of ``model``'s blocks (the
    model split as its ranks split it; its blocks found as the profile finds them); as it was where it has none."""
    from hybrid.plan.profile import find_blocks

    _, blocks = find_blocks(model)
    if blocks is None:
        return profile
    return dataclasses.replace(profile, tp_block=block_collectives(blocks[0], profile.width))
