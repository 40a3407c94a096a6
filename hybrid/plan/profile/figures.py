"""A model profile's figures and their scaling (pure: no torch).

``Scaling`` is one figure of a micro-step as ``b·s·(linear + quadratic·s)`` (b: micro-batch, s: sequence
length), fitted exactly through two measurements at one micro-batch; ``Part`` holds one block's (or everything
outside the blocks') FLOPs, saved bytes and eager ops; ``ModelProfile`` adds ``layers`` blocks to the outside
and answers at any ``(micro_batch, seq)``.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction


@dataclass(frozen=True)
class Scaling:
    """``b·s·(linear + quadratic·s)``: per token, and per token per token of the sequence (attention's s²)."""

    linear: float = 0.0
    quadratic: float = 0.0

    def at(self, micro_batch: int, seq: int) -> float:
        return micro_batch * seq * (self.linear + self.quadratic * seq)

    def per_token(self, seq: int) -> float:
        return self.linear + self.quadratic * seq

    def __add__(self, other: "Scaling") -> "Scaling":
        return Scaling(self.linear + other.linear, self.quadratic + other.quadratic)

    def times(self, k: float) -> "Scaling":
        return Scaling(self.linear * k, self.quadratic * k)

    @classmethod
    def fit(cls, batch: int, seqs: tuple, values: tuple) -> "Scaling":
        """The exact fit through ``values`` measured at ``(batch, s)`` for the two (different) ``seqs``."""
        (s1, s2), (v1, v2) = seqs, values
        y1, y2 = Fraction(v1) / (batch * s1), Fraction(v2) / (batch * s2)
        quadratic = (y1 - y2) / (s1 - s2)
        return cls(float(y1 - quadratic * s1), float(quadratic))


@dataclass(frozen=True)
class Part:
    """One block's, or everything outside the blocks', figures of a micro-step."""

    forward_flops: Scaling
    backward_flops: Scaling   # with activation checkpointing, the recomputed forward included
    saved_bytes: Scaling      # saved for backward at the end of forward (outside: the head's output included)
    ops: int                  # aten ops dispatched in forward and backward
    whole_bytes: Scaling = Scaling()  # of saved_bytes: those with the residual stream's width (whole at any TP)

    @property
    def flops(self) -> Scaling:
        return self.forward_flops + self.backward_flops


@dataclass(frozen=True)
class ModelProfile:
    """What one micro-step of a model costs, measured (``hybrid.plan.profile``), at any micro-batch and sequence."""

    model: str            # the model's class
    params: int           # the full model's parameters (its blocks counted ``layers`` times)
    layers: int           # blocks in the full model
    blocks: str           # the block list's qualified name ('' where the model has none)
    block: Part           # one block
    outside: Part         # embeddings, final norm, head and loss, and tensors the blocks share
    head: Scaling         # of outside.saved_bytes: from the head on (its input, the loss's) and its output (logits)
    checkpointing: bool   # each block recomputed in backward
    dtype: str            # the compute dtype the parameters were stood in by
    attention: str        # "fused": the SDPA kernel torch picks on a CPU; "math": SDPA's math path
    measured: tuple       # the (micro_batch, seq) points measured
    width: int = 0        # the residual stream's width: the last dimension of the blocks' input (0: no blocks)
    tensors: int = 0      # parameter tensors of the full model (its blocks' counted ``layers`` times)
    tp_block: object = None  # the TP collectives one block makes per micro-step (``hybrid.plan.cost.TpCalls``: calls
    #                          and elements per token, by style), counted from the split model's block by
    #                          ``hybrid.tp.traffic.with_block_collectives`` (None: not counted)

    def _total(self, pick) -> Scaling:
        return pick(self.block).times(self.layers) + pick(self.outside)

    @property
    def flop_terms(self) -> Scaling:
        """FLOPs per token of forward and backward: A (``linear``) and B (``quadratic``) of ``b·s·(A + B·s)``."""
        return self._total(lambda p: p.flops)

    def flops(self, micro_batch: int, seq: int) -> float:
        """Forward and backward FLOPs of one micro-step (with ``checkpointing``, the recompute included)."""
        return self.flop_terms.at(micro_batch, seq)

    def forward_flops(self, micro_batch: int, seq: int) -> float:
        return self._total(lambda p: p.forward_flops).at(micro_batch, seq)

    def flops_per_token(self, seq: int) -> float:
        return self.flop_terms.per_token(seq)

    def activation_bytes(self, micro_batch: int, seq: int) -> float:
        """Bytes saved for backward at the end of forward, all blocks and the head's output included."""
        return self._total(lambda p: p.saved_bytes).at(micro_batch, seq)

    def block_bytes(self, micro_batch: int, seq: int) -> float:
        """One block's saved bytes (with ``checkpointing``: what the checkpoint keeps, its inputs)."""
        return self.block.saved_bytes.at(micro_batch, seq)

    def block_whole_bytes(self, micro_batch: int, seq: int) -> float:
        """Of ``block_bytes``, those saved with the residual stream's width as their last dimension (its input,
        norms, residual sums, a row-parallel projection's input): what stays whole on every rank of a TP group
        that splits the rest of the block (heads, MLP columns)."""
        return self.block.whole_bytes.at(micro_batch, seq)

    def head_bytes(self, micro_batch: int, seq: int) -> float:
        """What is saved from the head on (its input, the loss's: a softmax) and the logits."""
        return self.head.at(micro_batch, seq)

    def ops_per_micro_step(self) -> int:
        return self.layers * self.block.ops + self.outside.ops
