"""What a module split by a TP plan computes: each style as a subclass of the module's own class.

``hybrid.tp.plan.apply_plan`` turns a matched module into an instance of ``split_class(style, type(module))``
in place (``module.__class__``, as FSDP2's ``fully_shard`` does): the module keeps its name, its attributes,
its hooks and its parameter names, stays an ``nn.Linear`` / ``nn.Embedding`` (or whatever it was) for every
``isinstance`` check (Hugging Face's ``_init_weights``, ``reset_parameters``), and only its forward changes.
The parameters of a split layer hold this TP rank's slice, marked with the dimension they are split along
(``hybrid.weights.attrs``); attributes such as ``out_features`` keep the full (single-process) sizes. The
split layers' classes are also ``hybrid.tp.layers.TensorParallelModule`` (last in the method order, so torch's
``__init__``, ``reset_parameters`` and repr win), so ``hybrid.initialize`` checks their TP group as for the
hybrid layers; ``all_reduce`` and ``replicate_grad`` wrap any module's own forward and split nothing.

==================  ==================  ===========================================================
style               split               forward
==================  ==================  ===========================================================
``colwise``         Linear weight and   the input enters the TP region (its gradient is summed over
                    bias by rows (0)    TP); the output is this rank's slice of the features
``colwise_rep``     as colwise          as colwise, then the output features all-gathered
``rowwise``         Linear weight by    the input is this rank's slice of the features; partial
                    columns (1); bias   products summed over TP (all-reduce), then the bias, once
                    replicated
``rowwise_rep``     as rowwise          the input is whole: this rank's slice is taken first
``local_rowwise``   as rowwise; no      the partial product, not summed: a module above it sums
                    bias allowed        (``all_reduce``)
``vocab``           Embedding rows (0)  ids outside this rank's rows look up zeros; the partial
                                        embeddings are summed over TP
``all_reduce``      nothing             any module: its output (or its first element) summed over TP
``replicate_grad``  nothing             any module: its parameters enter the TP region, so their
                                        gradients are summed over TP (a norm of this rank's heads)
==================  ==================  ===========================================================

Every collective is one of ``hybrid.tp.collectives``' autograd pairs, so traffic is counted on the TP
``Comm`` and the backward is the transposed collective. A group of one rank makes every collective the
identity, so at TP 1 a split module computes what the original did.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from hybrid.tp.collectives import (copy_to_tp_region, gather_from_tp_region, reduce_from_tp_region,
                                   scatter_to_tp_region)
from hybrid.tp.layers import TensorParallelModule, check_vocab_ids
from hybrid.tp.regions import ENTERED, SLICE, WHOLE


class SplitModule:
    """What every split module carries besides its own attributes: the TP comm, rank and size (set by
    ``apply_plan``: ``tp_comm``, ``tp_rank``, ``tp``), its style, and how its parameters are split."""

    tp_style = ""
    # hybrid.weights.sources: a parameter without a hybrid.weights.init initializer gets its slice of what the
    # module's own init (reset_parameters, init_fn) writes into the full tensor
    init_full_tensors = True
    torch_layer: Optional[type] = None  # the torch class this style splits (None: any module)
    split_dims: dict = {}  # parameter key -> the dimension it is split along (absent: replicated)
    split_size = ""  # the attribute holding the full size of the split dimension ("": splits nothing)
    output_kind: Optional[str] = None  # what the forward returns (hybrid.tp.regions); None: as its input

    def extra_repr(self) -> str:
        own = super().extra_repr()
        return f"{own}, tp={self.tp} ({self.tp_style})" if own else f"tp={self.tp} ({self.tp_style})"


class ColwiseLinear(SplitModule, nn.Linear, TensorParallelModule):
    tp_style, torch_layer, split_dims = "colwise", nn.Linear, {"weight": 0, "bias": 0}
    split_size, output_kind = "out_features", SLICE
    gather_output = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(copy_to_tp_region(x, self.tp_comm), self.weight, self.bias)
        return gather_from_tp_region(y, self.tp_comm) if self.gather_output else y


class ColwiseGatheredLinear(ColwiseLinear):
    tp_style, gather_output, output_kind = "colwise_rep", True, WHOLE


class RowwiseLinear(SplitModule, nn.Linear, TensorParallelModule):
    tp_style, torch_layer, split_dims = "rowwise", nn.Linear, {"weight": 1}
    split_size, output_kind = "in_features", WHOLE
    input_is_parallel, reduce_output = True, True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = scatter_to_tp_region(x, self.tp_comm)
        y = F.linear(x, self.weight)
        if not self.reduce_output:
            return y  # a partial sum (local_rowwise has no bias: apply_plan refuses one)
        y = reduce_from_tp_region(y, self.tp_comm, consume=True)
        return y if self.bias is None else y + self.bias  # once, after the sum


class RowwiseSplitInputLinear(RowwiseLinear):
    tp_style, input_is_parallel = "rowwise_rep", False


class LocalRowwiseLinear(RowwiseLinear):
    tp_style, reduce_output, output_kind = "local_rowwise", False, SLICE


class VocabEmbedding(SplitModule, nn.Embedding, TensorParallelModule):
    tp_style, torch_layer, split_dims = "vocab", nn.Embedding, {"weight": 0}
    split_size, output_kind = "num_embeddings", WHOLE

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp == 1:
            return F.embedding(ids, self.weight, self.padding_idx)
        local = self.weight.shape[0]
        start = self.tp_rank * local
        check_vocab_ids(ids, self.num_embeddings, "input")  # as F.embedding would: no rank owns such an id
        outside = (ids < start) | (ids >= start + local)
        padding = self.padding_idx - start if self.padding_idx is not None and 0 <= self.padding_idx - start < local \
            else None
        partial = F.embedding((ids - start).masked_fill(outside, 0), self.weight, padding)
        return reduce_from_tp_region(partial.masked_fill(outside.unsqueeze(-1), 0.0), self.tp_comm, consume=True)


class AllReduceOutput(SplitModule):
    """Sums a module's output over TP (its partial sums: ``local_rowwise`` layers inside it). Mixed in before
    the module's own class (its forward runs inside this one); not a ``TensorParallelModule``, whose methods
    would hide the module's own."""

    tp_style, output_kind = "all_reduce", WHOLE

    def forward(self, *args, **kwargs):
        out = super().forward(*args, **kwargs)
        if isinstance(out, torch.Tensor):
            return reduce_from_tp_region(out, self.tp_comm)
        if isinstance(out, tuple) and out and isinstance(out[0], torch.Tensor):
            return (reduce_from_tp_region(out[0], self.tp_comm), *out[1:])
        raise TypeError(f"{type(self).__name__} (all_reduce) returned {type(out).__name__}; all_reduce sums a "
                        "module's output tensor (or the first element of its output tuple)")


class GradSummedReplica(SplitModule):
    """A module whose parameters are whole on every rank but see only this rank's part of the activations (a
    norm applied to each of this rank's heads, Qwen3's ``q_norm``): in its forward each parameter enters the TP
    region (identity; its gradient summed over TP), so every rank steps it with the whole gradient. Mixed in
    before the module's own class, as ``AllReduceOutput``."""

    tp_style = "replicate_grad"
    summed_keys: Optional[tuple] = None  # which of its own parameters (None: all of them)

    def forward(self, *args, **kwargs):
        keys = self.summed_keys
        own = {key: p for key, p in self._parameters.items() if p is not None and (keys is None or key in keys)}
        for key, param in own.items():  # for this call only: the module keeps its parameters
            self._parameters[key] = copy_to_tp_region(param, self.tp_comm)
        try:
            return super().forward(*args, **kwargs)
        finally:
            self._parameters.update(own)


class ColumnEmbedding(SplitModule, nn.Embedding, TensorParallelModule):
    """An embedding split along its vectors (transformers' ``embedding_colwise``): each rank looks up its
    columns of every id, and the columns are all-gathered (their gradient split back)."""

    tp_style, torch_layer, split_dims = "embedding_col", nn.Embedding, {"weight": 1}
    split_size, output_kind = "embedding_dim", WHOLE

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = F.embedding(ids, self.weight, self.padding_idx)
        return gather_from_tp_region(local, self.tp_comm)


class MlaKvAProjLinear(SplitModule, nn.Linear, TensorParallelModule):
    """DeepSeek-V2-style attention's ``kv_a_proj_with_mqa``: whole, but its last ``rope_dim`` output features
    (the rotary key, shared by every head) go straight into this rank's heads, so their gradient is summed over
    TP; the other features reach the heads through a ``colwise`` layer, which sums its input's gradient itself.
    ``rope_dim`` is the model config's ``qk_rope_head_dim`` (``apply_plan`` sets it)."""

    tp_style, torch_layer, output_kind = "mla_kv_a_proj", nn.Linear, ENTERED
    rope_dim = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight, self.bias)
        kept, rope = y.split([y.shape[-1] - self.rope_dim, self.rope_dim], dim=-1)
        return torch.cat([kept, copy_to_tp_region(rope, self.tp_comm)], dim=-1)


class KeptModule(SplitModule):
    """``replicate``: the module left as it is (a model's own plan may name a module only to say so)."""

    tp_style = "replicate"


STYLE_CLASSES = {cls.tp_style: cls for cls in (ColwiseLinear, ColwiseGatheredLinear, RowwiseLinear,
                                                RowwiseSplitInputLinear, LocalRowwiseLinear, VocabEmbedding,
                                                AllReduceOutput, GradSummedReplica, ColumnEmbedding,
                                                MlaKvAProjLinear, KeptModule)}

_CLASSES: dict = {}


def split_class(style: str, cls: type) -> type:
    """The class a module of class ``cls`` becomes under ``style``: the style's own class for torch's
    ``nn.Linear`` / ``nn.Embedding`` themselves, else a subclass of both (``cls`` first, so its own methods
    stay; its forward must be torch's, which ``apply_plan`` checks); for ``all_reduce``, ``cls`` with the
    output's sum around its own forward."""
    base = STYLE_CLASSES[style]
    if cls is base.torch_layer:
        return base
    key = (style, cls)
    if key not in _CLASSES:
        bases = (base, cls) if base.torch_layer is None else (cls, base)
        _CLASSES[key] = type(f"{base.__name__}{cls.__name__}", bases, {"__module__": __name__})
    return _CLASSES[key]
