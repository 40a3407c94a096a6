"""Megatron-style tensor-parallel layers on plain tensors.

* ``ColumnParallelLinear``: ``Y = X·Wᵀ`` with W split by output rows; each TP rank computes its slice of
  the output features. Its weight and bias are marked TP along dim 0. ``gather_output`` all-gathers the
  output features; otherwise the output stays in the TP region for a following row-parallel layer.
* ``RowParallelLinear``: W split by input columns; each rank multiplies its slice of the input features
  and the partial results are summed (all-reduce). Its weight is marked TP along dim 1; the bias is
  replicated (unmarked) and added once, after the reduce.
* ``VocabParallelEmbedding``: the table split by vocabulary rows; ids outside this rank's range look up
  zeros and the partial embeddings are summed.

``tp_comm=None`` (or a group of size 1) gives the plain single-process layer. Parameters are created on
``device`` and drawn from their ``hybrid.weights.init`` initializers (weights N(0, init_std²), biases zero):

* ``seed=TORCH_RNG`` (the default): from torch's default generator, as ``nn.Linear`` does, so two layers
  differ; each TP rank draws the *full* tensor and keeps its slice, so a model built after
  ``torch.manual_seed(s)`` on every rank is the same model at every TP degree;
* ``seed=S`` (an int): the layer's own seeded draw keyed by ``(S, "weight")`` -- each TP rank draws only its
  slice; layers given the same S get the same values;
* ``seed=None``: left to an owner that initializes them by their qualified names
  (``reset_parameters(seed, prefix)``), as ``hybrid.models.gpt`` does.

On the meta device nothing is drawn: ``hybrid.initialize`` / ``hybrid.materialize`` draw each parameter
from ``(seed, qualified name)``.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from hybrid.comm.collectives import Comm
from hybrid.weights.attrs import mark_tensor_parallel
from hybrid.weights.init import Constant, Normal, set_initializer
from hybrid.tp.collectives import (copy_to_tp_region, gather_from_tp_region, reduce_from_tp_region,
                                   scatter_to_tp_region)
from hybrid.tp.sharding import divide, init_param_, init_param_from_torch_rng_, tp_rank_size

TORCH_RNG = "torch"  # the default ``seed``: draw from torch's default generator


def check_vocab_ids(ids: torch.Tensor, vocab_size: int, what: str) -> None:
    """Refuse ids outside ``[0, vocab_size)`` as a single-process lookup would: an IndexError on CPU, a
    device-side assert on an accelerator (checked asynchronously: no host sync per step)."""
    bad = (ids < 0) | (ids >= vocab_size)
    if ids.device.type == "cpu":
        if bad.any():
            found = ids[bad][0].item()
            raise IndexError(f"{what} id {found} is outside the vocabulary [0, {vocab_size})")
    else:
        torch._assert_async(~bad.any(), f"{what} ids must lie in [0, {vocab_size})")


class TensorParallelModule(nn.Module):
    """Shared bookkeeping: the TP comm, its rank/size, and the seeded weight init."""

    def __init__(self, tp_comm: Optional[Comm], init_std: float):
        super().__init__()
        self.tp_comm = tp_comm
        self.tp_rank, self.tp = tp_rank_size(tp_comm)
        self.init_std = init_std

    def tp_split(self) -> tuple[int, Optional[Comm]]:
        """``(TP degree, TP comm)`` this layer's parameters are split over: what the ZeRO engine reads of a
        TP layer (``hybrid.zero.tp_interface.SplitOverTP``)."""
        return self.tp, self.tp_comm

    def _maybe_init(self, seed) -> None:
        set_initializer(self.weight, Normal(std=self.init_std))
        if getattr(self, "bias", None) is not None:
            set_initializer(self.bias, Constant(0.0))
        if seed is None or self.weight.device.type == "meta":
            return
        if seed == TORCH_RNG:
            for param in self._parameters.values():
                if param is not None:
                    init_param_from_torch_rng_(param, self.tp_rank, self.tp)  # under no_grad
        elif isinstance(seed, int) and not isinstance(seed, bool):
            self.reset_parameters(seed)
        else:
            raise ValueError(f"seed must be an int, None or hybrid.tp.TORCH_RNG, not {seed!r}")

    @torch.no_grad()
    def reset_parameters(self, seed: int = 0, prefix: str = "") -> None:
        for key, param in self._parameters.items():
            if param is not None:
                init_param_(param, seed, prefix + key, self.tp_rank, self.tp)


class ColumnParallelLinear(TensorParallelModule):
    def __init__(self, in_features: int, out_features: int, bias: bool = True, tp_comm: Optional[Comm] = None,
                 gather_output: bool = False, init_std: float = 0.02, seed=TORCH_RNG,
                 device=None, dtype=None):
        super().__init__(tp_comm, init_std)
        self.in_features, self.out_features = in_features, out_features
        self.gather_output = gather_output
        local_out = divide(out_features, self.tp, "out_features")
        kw = dict(device=device, dtype=dtype)
        self.weight = mark_tensor_parallel(nn.Parameter(torch.empty(local_out, in_features, **kw)), 0)
        self.bias = mark_tensor_parallel(nn.Parameter(torch.empty(local_out, **kw)), 0) if bias else None
        self._maybe_init(seed)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(copy_to_tp_region(x, self.tp_comm), self.weight, self.bias)
        return gather_from_tp_region(y, self.tp_comm) if self.gather_output else y

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, tp={self.tp}, "
                f"gather_output={self.gather_output}")


class RowParallelLinear(TensorParallelModule):
    def __init__(self, in_features: int, out_features: int, bias: bool = True, tp_comm: Optional[Comm] = None,
                 input_is_parallel: bool = True, init_std: float = 0.02, seed=TORCH_RNG,
                 device=None, dtype=None):
        super().__init__(tp_comm, init_std)
        self.in_features, self.out_features = in_features, out_features
        self.input_is_parallel = input_is_parallel
        local_in = divide(in_features, self.tp, "in_features")
        kw = dict(device=device, dtype=dtype)
        self.weight = mark_tensor_parallel(nn.Parameter(torch.empty(out_features, local_in, **kw)), 1)
        self.bias = nn.Parameter(torch.empty(out_features, **kw)) if bias else None  # replicated
        self._maybe_init(seed)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = scatter_to_tp_region(x, self.tp_comm)
        y = reduce_from_tp_region(F.linear(x, self.weight), self.tp_comm, consume=True)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, tp={self.tp}, "
                f"input_is_parallel={self.input_is_parallel}")


class VocabParallelEmbedding(TensorParallelModule):
    def __init__(self, num_embeddings: int, embedding_dim: int, tp_comm: Optional[Comm] = None,
                 init_std: float = 0.02, seed=TORCH_RNG, device=None, dtype=None):
        super().__init__(tp_comm, init_std)
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        local = divide(num_embeddings, self.tp, "vocab_size")
        self.vocab_start, self.vocab_end = self.tp_rank * local, (self.tp_rank + 1) * local
        self.weight = mark_tensor_parallel(
            nn.Parameter(torch.empty(local, embedding_dim, device=device, dtype=dtype)), 0)
        self._maybe_init(seed)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp == 1:
            return F.embedding(ids, self.weight)
        check_vocab_ids(ids, self.num_embeddings, "input")  # as F.embedding would: no rank owns such an id
        outside = (ids < self.vocab_start) | (ids >= self.vocab_end)
        local_ids = (ids - self.vocab_start).masked_fill(outside, 0)
        partial = F.embedding(local_ids, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_from_tp_region(partial, self.tp_comm, consume=True)

    def extra_repr(self) -> str:
        return f"num_embeddings={self.num_embeddings}, embedding_dim={self.embedding_dim}, tp={self.tp}"
