"""Tensor parallelism inside a node: Megatron-style layers, their autograd collectives, the loss, and TP plans
for models written without them.

See ``collectives`` (the four forward/backward pairs), ``layers`` (column/row parallel linear,
vocab-parallel embedding), ``loss`` (vocab-parallel cross-entropy, and a causal LM's loss over it),
``sharding`` (full ↔ slice), ``plan`` (``apply_plan``: module-name patterns -> styles, applied to a built
model), ``styles`` (what a split ``nn.Linear`` / ``nn.Embedding`` computes), ``hf`` (a Hugging Face model's own
plan) and ``hf_logits`` (its logits left split by vocabulary, its loss vocab-parallel).
"""

from hybrid.tp.collectives import (copy_to_tp_region, gather_from_tp_region, reduce_from_tp_region,
                                   scatter_to_tp_region)
from hybrid.tp.layers import TORCH_RNG, ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from hybrid.tp.loss import causal_lm_loss, vocab_parallel_cross_entropy
from hybrid.tp.sharding import gather_tp_state_dict, slice_tp_state_dict, tp_slice
from hybrid.config.tp_plan import STYLES
from hybrid.tp.plan import apply_plan, check_plan
from hybrid.tp.hf import hf_plan, parallelize, splits_logits
from hybrid.tp.hf_config import largest_tp

__all__ = [
    "copy_to_tp_region", "reduce_from_tp_region", "scatter_to_tp_region", "gather_from_tp_region",
    "TORCH_RNG", "ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding", "vocab_parallel_cross_entropy",
    "causal_lm_loss",
    "gather_tp_state_dict", "slice_tp_state_dict", "tp_slice",
    "STYLES", "apply_plan", "check_plan", "hf_plan", "largest_tp", "parallelize", "splits_logits",
]
