"""Where whole tensors meet this rank's slice of the features under a TP plan: found from the model itself.

Between a ``colwise`` layer and the ``rowwise`` layer that sums its slices, each TP rank computes only its
part of the features (its heads, its MLP columns). A parameter left whole that acts on those features -- Qwen3's
per-head ``q_norm``, Apertus's xIELU activation scalars, a norm or gate of one's own -- gets on each rank the
gradient of that rank's slice only; the single-process gradient is their sum over TP. Nobody has to list such
parameters: ``trace_regions`` reads the model's forward run once on fake tensors (``hybrid.tp.forward_record``:
nothing allocated, no values, the unsplit model with every parameter and buffer swapped for a meta stand-in) and
follows every tensor of its torch-function-level calls:

- a *slice*: the output of a module whose style leaves this rank's features (``colwise``, ``local_rowwise``,
  ``packed_colwise``, ...), and everything computed from one;
- *whole*: an activation, computed from the model's input (the residual stream; the output of a ``rowwise`` or
  a gathering module; an attention mask);
- *entered*: whole, its gradient already summed over TP where it meets slices (``mla_kv_a_proj``'s output);
- *from parameters*: computed from parameters alone (``weight.float()``, ``1 + weight``), which remembers
  which ones.

Parameters the plan splits, or sums the gradient of (``replicate_grad``), are the plan's business and are not
followed. The result (``RegionTrace``): the parameters that meet slices only (their gradients must be summed
over TP: ``hybrid.tp.plan`` gives their modules ``replicate_grad``), those that meet slices and whole
activations both (no sum makes both exact), the first operation where a whole activation that needs a
gradient meets a slice (its gradient would be partial, and nothing upstream could tell), and the first that
reduces over a slice's split features (a mean, a norm, a top-k over the MLP's columns: each rank would compute
its part's, and the forward itself would differ). A forward that cannot
run on meta (data-dependent Python, an op without a meta kernel) gives ``error``: what stopped it, one line.
The run is the one ``hybrid.tp.hf_logits`` reads too: inside ``forward_record.shared(model)`` it is made once.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from hybrid.tp.forward_record import record_forward

SLICE, WHOLE, ENTERED, PARAMS = "slice", "whole", "entered", "params"


@dataclass
class RegionTrace:
    partial: dict = field(default_factory=dict)   # parameter name -> the op where it met a slice (and only slices)
    mixed: dict = field(default_factory=dict)     # parameter name -> the op where it met a slice, having met whole ones
    activation: Optional[str] = None              # the first op where a whole activation with a gradient met a slice
    reduction: Optional[str] = None               # the first op that reduces over the split features of a slice
    error: Optional[str] = None                   # why the forward did not run on meta (None: it ran)


# Ops whose result over a dimension needs all of it: over the split features of a slice, each rank would compute
# its part's mean, norm or top-k (Gemma 3n's activation sparsity: a mean and std over the MLP's features).
REDUCTIONS = {"mean", "sum", "std", "var", "std_mean", "var_mean", "norm", "vector_norm", "amax", "amin", "max",
              "min", "topk", "sort", "softmax", "log_softmax", "logsumexp", "cumsum", "argmax", "argmin",
              "layer_norm", "rms_norm", "group_norm", "normalize", "kthvalue", "median", "quantile"}


def _reduced_dims(op: str, t: torch.Tensor, args: tuple, kwargs: dict) -> list:
    """The dimensions of ``t`` (the op's first argument) the reduction ``op`` runs over."""
    if op in ("layer_norm", "rms_norm"):
        shape = args[1] if len(args) > 1 else kwargs.get("normalized_shape", ())
        shape = (shape,) if isinstance(shape, int) else tuple(shape)
        return list(range(t.dim() - len(shape), t.dim()))
    if op == "group_norm":
        return list(range(1, t.dim()))
    if len(args) > 1 and isinstance(args[1], torch.Tensor) or isinstance(kwargs.get("other"), torch.Tensor):
        return []  # min(a, b), max(a, b): elementwise
    dim = kwargs.get("dim", args[1] if len(args) > 1 and not isinstance(args[1], torch.Tensor) else None)
    if op in ("topk", "kthvalue"):
        dim = kwargs.get("dim", args[2] if len(args) > 2 else -1)
    if dim is None:
        return [] if op in ("sort", "softmax", "log_softmax", "cumsum", "normalize") else list(range(t.dim()))
    dims = dim if isinstance(dim, (tuple, list)) else (dim,)
    return [d % t.dim() for d in dims if isinstance(d, int)] if t.dim() else []


def _op_name(func) -> str:
    name = getattr(func, "__name__", None) or repr(func)
    return name.replace("__", "") if name.startswith("__") else name


class _Follow:
    """Classifies every tensor a call makes from the kinds of its inputs (see the module docstring); the
    record keeps every tensor alive, so ids are not reused while it is read."""

    def __init__(self, params: dict, trace: RegionTrace):
        self.params = params  # id(stand-in) -> parameter name, for the parameters the plan leaves to us
        self.kinds: dict = {}  # id(tensor) -> (kind, frozenset of parameter names)
        self.widths: dict = {}  # id(slice) -> the full width of the features split along its last dimension
        self.whole_use: dict = {}  # parameter name -> first op where it met a whole activation
        self.trace = trace

    def kind_of(self, t: torch.Tensor):
        known = self.kinds.get(id(t))
        if known is not None:
            return known
        if id(t) in self.params:
            return PARAMS, frozenset((self.params[id(t)],))
        return None, frozenset()  # a constant: a buffer, a parameter the plan takes care of, a new tensor

    def mark(self, t: torch.Tensor, kind: str, names=frozenset()) -> None:
        self.kinds[id(t)] = (kind, names)

    def module_output(self, module: nn.Module, kind: str, out) -> None:
        t = _first_tensor(out)
        if t is not None:
            self.mark(t, kind)
            if kind == SLICE and t.dim() and t.shape[-1] == getattr(module, "out_features", None):
                self.widths[id(t)] = t.shape[-1]  # a colwise output: its features are the split ones

    def call(self, func, args: tuple, kwargs: dict, out) -> None:
        inputs = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        if not inputs:
            return
        kinds = [self.kind_of(t) for t in inputs]
        present = {k for k, _ in kinds}
        named = frozenset().union(*(names for k, names in kinds if k == PARAMS))
        op = _op_name(func)
        if SLICE in present:
            kind = SLICE
            width = next((self.widths[id(t)] for t in inputs if id(t) in self.widths), None)
            if op in REDUCTIONS and self.trace.reduction is None and id(inputs[0]) in self.widths:
                first = inputs[0]
                if any(d == first.dim() - 1 and first.shape[d] == self.widths[id(first)]
                       for d in _reduced_dims(op, first, args, kwargs)):
                    self.trace.reduction = op
            for name in named:
                if name in self.whole_use:
                    self.trace.mixed.setdefault(name, op)
                else:
                    self.trace.partial.setdefault(name, op)
            needs_grad = any(k == WHOLE and t.requires_grad for t, (k, _) in zip(inputs, kinds))
            if needs_grad and self.trace.activation is None:
                self.trace.activation = op
        elif WHOLE in present or ENTERED in present:
            kind = WHOLE if WHOLE in present else ENTERED
            for name in named:
                self.whole_use.setdefault(name, op)
                if name in self.trace.partial:
                    self.trace.mixed.setdefault(name, self.trace.partial.pop(name))
        elif named:
            kind = PARAMS
        else:
            return
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.mark(t, kind, named if kind == PARAMS else frozenset())
                if kind == SLICE and width is not None and t.dim() and t.shape[-1] == width:
                    self.widths[id(t)] = width  # the split features still last (not viewed into heads)


def _first_tensor(out):
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
        return out[0]
    return None


def trace_regions(model: nn.Module, outputs: dict, skip: set, example: Optional[tuple] = None) -> RegionTrace:
    """Follow the tensors of ``model``'s forward on meta (module docstring; the run: ``record_forward``).
    ``outputs``: module -> the kind its output is (``SLICE``, ``WHOLE`` or ``ENTERED``); ``skip``: ids of the
    parameters the plan takes care of; ``example``: the forward's positional arguments on meta (default: token
    ids, as ``record_forward`` gives them)."""
    record = record_forward(model, example)
    trace = RegionTrace()
    followed = {id(record.stand_ins[name]): name for name, p in model.named_parameters()
                if id(p) not in skip and p.requires_grad}
    follow = _Follow(followed, trace)
    for t in record.inputs:
        follow.mark(t, WHOLE)
    for entry in record.entries:
        if entry[0] == "call":
            follow.call(*entry[1:])
        elif entry[0] == "module" and entry[1] in outputs:
            follow.module_output(entry[1], outputs[entry[1]], entry[2])
    if record.error is not None:  # the model's own code: what stopped it is the answer, in one line
        kind, text = record.error
        trace.error = f"{kind}: {text[:200] or 'no message'}"
    return trace
