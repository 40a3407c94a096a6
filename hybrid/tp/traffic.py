"""The TP collectives a module split by a plan makes per micro-step, counted from its split modules' styles.

``block_collectives(block)`` walks one block of a model that ``hybrid.tp.apply_plan`` split (at any TP degree,
TP 1 included: the modules already are their styles' classes) and counts, per forward and backward of one
micro-step, the all-reduces each style's forward (``hybrid.tp.styles``) makes:

- ``colwise`` (and ``colwise_rep``): the input enters the TP region, so its gradient is summed in backward (one
  call of ``in_features`` per token); ``colwise_rep`` also gathers its output in forward (``out_features``);
- ``mla_kv_a_proj``: its rotary features' gradient in backward (``rope_dim``);
- ``rowwise`` / ``rowwise_rep``: the output's partial sums, in forward (``out_features``); ``local_rowwise`` none;
- ``all_reduce``: its output in forward (counted at the block's residual width, ``width``);
- ``replicate_grad``: each of its parameters' gradients in backward (latency only: not per token).

The time model (``hybrid.plan.cost.tp_traffic``) prices these instead of the built-in GPT's two calls in
forward and two in backward per block, which a plan that splits q, k and v (or gate and up) one module at a time
exceeds: a Llama block makes 2 in forward and 5 in backward.
"""

from __future__ import annotations

from torch import nn

from hybrid.plan.cost import TpCalls
from hybrid.tp import styles


def block_collectives(block: nn.Module, width: int) -> TpCalls:
    """The TP calls of one micro-step of ``block`` (see the module docstring); ``width``: the residual stream's
    features per token, for an ``all_reduce`` module whose output width is not its own attribute."""
    forward = backward = forward_width = backward_width = 0
    for module in block.modules():
        if isinstance(module, styles.ColwiseLinear):
            backward, backward_width = backward + 1, backward_width + module.in_features
            if isinstance(module, styles.ColwiseGatheredLinear):
                forward, forward_width = forward + 1, forward_width + module.out_features
        elif isinstance(module, styles.MlaKvAProjLinear):
            backward, backward_width = backward + 1, backward_width + module.rope_dim
        elif isinstance(module, styles.RowwiseLinear):
            if not isinstance(module, styles.LocalRowwiseLinear):
                forward, forward_width = forward + 1, forward_width + module.out_features
        elif isinstance(module, styles.AllReduceOutput):
            forward, forward_width = forward + 1, forward_width + width
        elif isinstance(module, styles.GradSummedReplica):
            backward += sum(1 for _ in module.parameters(recurse=False))
    return TpCalls(forward, backward, forward_width, backward_width)
