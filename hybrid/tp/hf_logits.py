"""A Hugging Face causal LM's logits left split by vocabulary at TP > 1, its loss vocabulary-parallel.

transformers' own plans gather the head's logits (``lm_head: colwise_gather_output``) so that the model's loss
reads them whole: every TP rank then holds all ``b·s·V`` logits, and the loss an fp32 copy of them. Instead,
``split_logits`` leaves the head column-parallel with this rank's ``V/tp`` logits and makes the model's
``loss_function`` ``hybrid.tp.loss.causal_lm_loss`` over the head's TP group (transformers' ``ForCausalLMLoss``
over vocabulary slices: its label shift, ``ignore_index`` and reduction), as torchtitan's ``loss_parallel`` and
the built-in GPT do. ``model(input_ids=..., labels=...).loss`` is then the single-process loss, and its
``.logits`` are this rank's slice.

Whether a model's forward allows it is read from the forward itself (``logits_refusal``): run once on meta
(``hybrid.tp.forward_record``: fake tensors, the model's parameters swapped for stand-ins; the run
``hybrid.tp.regions`` reads too), every aten op from the head's matrix product (``F.linear`` with its weight:
what a head class of its own does after it counts too) to the loss must act on
each logit alone -- a cast, a view that keeps the vocabulary last, a slice of the positions, arithmetic with a
number (Gemma 2's soft-capping ``tanh(z / c) · c``, Cohere's ``logit_scale``) -- and the loss must be
transformers' causal-LM loss, called through ``self.loss_function`` with those logits. Anything else (a
reduction or a slice over the vocabulary, a tensor over it added or multiplied: Dory's per-token scale, a loss
of the model's own, a forward that does not run on meta) keeps the gathered head, and the reason is logged and
in the plan's notes (``hybrid.tp.plan.plan_notes``).
"""

from __future__ import annotations

import functools
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._pytree import tree_leaves

from hybrid.comm.collectives import Comm
from hybrid.tp.forward_record import causal_lm, record_forward
from hybrid.tp.loss import causal_lm_loss
from hybrid.tp.styles import ColwiseGatheredLinear, ColwiseLinear, split_class

# ops that act on each element alone without a pointwise tag: casts and copies
_COPIES = {"_to_copy", "clone", "alias", "detach", "lift_fresh", "contiguous", "_assert_tensor_metadata"}
# ops that move elements without mixing them; slicing ones are checked to leave the vocabulary (last) dimension
_VIEWS = {"view", "_unsafe_view", "reshape", "unsqueeze", "squeeze", "expand", "slice", "select", "narrow"}
_SLICING = {"slice", "select", "narrow"}


class _FollowLogits:
    """Follows the head's product (and what is computed from it) through the recorded aten ops; the first op
    that is not elementwise over the vocabulary is ``refusal``. ``loss_calls``: whether each call of the loss
    got them. The head's product is its matrix product itself (``F.linear`` with its weight), not the head
    module's output: a head of its own may do more inside its forward (Dory's per-token ``logit_scale``, a
    whole vector over the vocabulary), which must be followed too."""

    def __init__(self, weight: torch.Tensor):
        self.weight = weight  # the head weight's stand-in
        self.followed: set = set()  # ids of the logits and what was computed from them (the record holds them)
        self.refusal: Optional[str] = None
        self.loss_calls: list = []  # per call of the loss function: whether its logits were followed ones

    def follow(self, out) -> None:
        self.followed.update(id(t) for t in tree_leaves(out) if isinstance(t, torch.Tensor))

    def call(self, func, args: tuple, kwargs: dict, out) -> None:
        if func is F.linear and (args[1] if len(args) > 1 else kwargs.get("weight")) is self.weight:
            self.follow(out)

    def op(self, func, args: tuple, kwargs: dict, out) -> None:
        if self.refusal is not None:
            return
        inputs = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        logits = next((t for t in inputs if id(t) in self.followed), None)
        if logits is None:
            return
        self.refusal = _not_elementwise(func, logits, inputs, args, out, self.followed)
        if self.refusal is None:
            self.follow(out)

    def loss(self, args: tuple, kwargs: dict) -> None:
        logits = kwargs.get("logits", args[0] if args else None)
        self.loss_calls.append(isinstance(logits, torch.Tensor) and id(logits) in self.followed)


def _not_elementwise(func, logits: torch.Tensor, inputs: list, args: tuple, out, followed: set) -> Optional[str]:
    """Why ``func`` (an aten op taking the followed ``logits``) does not act on each logit alone, or None."""
    name = func.overloadpacket.__name__
    width = logits.shape[-1] if logits.dim() else None
    outs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
    if not outs:
        return None  # a question about the tensor (its device, its sizes), not a computation
    if any(t.dim() == 0 or t.shape[-1] != width for t in outs):
        return f"its forward applies {name} over the vocabulary of the logits before the loss"
    if torch.Tag.pointwise in func.tags or name in _COPIES:
        other = next((t for t in inputs if id(t) not in followed and t.dim() and t.shape[-1] != 1), None)
        if other is not None:
            return (f"its forward combines the logits with a tensor over the vocabulary ({name} with a tensor of "
                    f"shape {tuple(other.shape)}) before the loss")
        return None
    if name in _VIEWS:
        dim = args[1] if name in _SLICING and len(args) > 1 else None
        if isinstance(dim, int) and dim % logits.dim() == logits.dim() - 1:
            return f"its forward takes a {name} of the vocabulary of the logits before the loss"
        return None
    return f"its forward applies {name} to the logits before the loss"


def output_head(model: nn.Module) -> Optional[nn.Module]:
    """The model's output embedding (``get_output_embeddings()``: a causal LM's ``lm_head``), or None."""
    get = getattr(model, "get_output_embeddings", None)
    try:
        head = get() if callable(get) else None
    except (NotImplementedError, AttributeError):
        return None
    return head if isinstance(head, nn.Linear) else None


def logits_refusal(model: nn.Module) -> Optional[str]:
    """Why the model's logits cannot stay split by vocabulary with a vocabulary-parallel loss (one phrase), or
    None when they can (module docstring). ``model``: whole, or split at TP 1 (as the launcher holds it); the
    answer is kept on the model, as it depends on its code alone."""
    known = model.__dict__.get("_hybrid_logits_refusal", False)
    if known is not False:
        return known
    refusal = _trace_refusal(model)
    model.__dict__["_hybrid_logits_refusal"] = refusal
    return refusal


def _trace_refusal(model: nn.Module) -> Optional[str]:
    cls = type(model).__name__
    head = output_head(model)
    if head is None:
        return f"{cls} has no nn.Linear output embedding (get_output_embeddings)"
    if not causal_lm(model):
        return f"{cls}'s loss_function is not transformers' ForCausalLMLoss"
    record = record_forward(model)
    if record.error is not None:  # the model's own code: what stopped it, in one line
        kind, text = record.error
        return f"{cls}'s forward did not run on meta ({kind}: {text[:160]})"
    weight = next(record.stand_ins[name] for name, p in model.named_parameters() if p is head.weight)
    follow = _FollowLogits(weight)
    for kind, *event in record.entries:
        if kind == "call":
            follow.call(*event)
        elif kind == "op":
            follow.op(*event)
        elif kind == "loss":
            follow.loss(*event)
    if follow.refusal is not None:
        return follow.refusal
    if not follow.loss_calls:
        return f"{cls}'s forward computes its loss without self.loss_function"
    if not all(follow.loss_calls):
        return f"{cls}'s forward gives self.loss_function other logits than its head's"
    return None


def split_logits(model: nn.Module, tp_comm: Optional[Comm]) -> None:
    """Leave the logits of ``model``'s head -- column-parallel with gathered output (``colwise_rep``), split
    already by ``apply_plan`` over ``tp_comm`` -- as this rank's vocabulary slice, and make the model's loss
    ``causal_lm_loss`` over ``tp_comm``. The caller has asked ``logits_refusal`` of the model before splitting."""
    head = output_head(model)
    if not isinstance(head, ColwiseGatheredLinear):
        raise ValueError(f"split_logits: {type(model).__name__}'s output embedding is not split colwise_rep "
                         "(apply its plan first)")
    # split_class("colwise_rep", cls) is (cls, ColwiseGatheredLinear) for a subclass of nn.Linear
    head.__class__ = (ColwiseLinear if type(head) is ColwiseGatheredLinear else
                      split_class("colwise", type(head).__bases__[0]))
    model.loss_function = functools.partial(causal_lm_loss, tp_comm=tp_comm)


def uses_split_logits(model: nn.Module) -> bool:
    """Whether ``split_logits`` made ``model``'s loss vocabulary-parallel."""
    loss = model.__dict__.get("_loss_function")
    return isinstance(loss, functools.partial) and loss.func is causal_lm_loss
