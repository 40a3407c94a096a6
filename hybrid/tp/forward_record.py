"""A model's forward run once on fake tensors and recorded, so that each question TP asks of it reads one run.

``hybrid.tp.regions`` (which whole parameters meet this rank's slice of the features) and ``hybrid.tp.hf_logits``
(whether the logits may stay split by vocabulary) both follow the unsplit model's forward. ``record_forward``
runs it once -- on the meta device, nothing allocated, every parameter and buffer swapped for a meta stand-in
(of the parameter's ``requires_grad``) by ``torch.func.functional_call``, under ``FakeTensorMode`` so that a
model's checks that would read values (transformers' packed-sequence test) know it as a trace and skip
themselves -- and keeps, in the order they finish:

- ``("call", func, args, kwargs, out)``: every torch-function-level call (``F.linear``, ``Tensor.mean``, ...);
- ``("op", func, args, kwargs, out)``: every aten op under them;
- ``("module", module, out)``: every module's output;
- ``("loss", args, kwargs)``: every call of the model's ``loss_function``.

A causal LM whose loss is transformers' own (``ForCausalLMLoss``: ``causal_lm(model)``) is called with
``input_ids`` and ``labels`` (another tensor), its ``loss_function`` replaced for the run by one that records
its arguments and returns 0 (no loss is computed); any other model with token ids for each argument its
forward requires (``token_arguments``) or the ``example`` given. The record holds every tensor the run made,
so that no ``id`` is reused while it is read. A forward that cannot run on meta (data-dependent Python, an op
without a meta kernel) leaves the entries up to where it stopped and ``error``: the exception's type and
message, the message on one line.

Inside ``shared(model)`` the first record of the model is reused by the later questions (``parallelize`` asks
both of the one whole model before it splits it); outside, each question runs the forward again.
"""

from __future__ import annotations

import inspect
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

TRACE_TOKENS = 8  # the meta input's sequence length: enough for every position-dependent path
_SHARED = "_hybrid_forward_record"  # the model's __dict__ key inside shared(): its record, or None before one
_NONE = object()


@dataclass
class ForwardRecord:
    entries: list = field(default_factory=list)    # the run's events, in the order they finished (module docstring)
    stand_ins: dict = field(default_factory=dict)  # parameter or buffer name -> its meta stand-in
    inputs: tuple = ()                             # the token ids the forward was given (labels not among them)
    error: Optional[tuple] = None                  # (exception type name, message on one line); None: it ran


class _Calls(TorchFunctionMode):
    def __init__(self, entries: list):
        super().__init__()
        self.entries = entries

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.entries.append(("call", func, args, kwargs, out))
        return out


class _Ops(TorchDispatchMode):
    def __init__(self, entries: list):
        super().__init__()
        self.entries = entries

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.entries.append(("op", func, args, kwargs, out))
        return out


def trace_tokens(model: nn.Module) -> int:
    """The meta input's length: ``TRACE_TOKENS``, or fewer where the model has fewer positions."""
    limit = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    return min(TRACE_TOKENS, limit) if isinstance(limit, int) and limit > 0 else TRACE_TOKENS


def token_arguments(model: nn.Module) -> tuple:
    """Token ids (one row of ``trace_tokens``) for each argument its forward requires -- a causal LM's
    ``input_ids``, a model of one's own ``(ids, targets)`` -- on meta."""
    ids = torch.zeros((1, trace_tokens(model)), dtype=torch.long, device="meta")
    try:
        params = inspect.signature(model.forward).parameters.values()
    except (TypeError, ValueError):
        return (ids,)
    required = [p for p in params if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return (ids,) * max(len(required), 1)


def transformers_causal_lm_loss():
    """transformers' ``ForCausalLMLoss``, or None without transformers."""
    try:
        from transformers.loss.loss_utils import ForCausalLMLoss
    except ImportError:
        return None
    return ForCausalLMLoss


def causal_lm(model: nn.Module) -> bool:
    """Whether ``model``'s loss is transformers' causal-LM loss (``self.loss_function``)."""
    loss = transformers_causal_lm_loss()
    return loss is not None and getattr(model, "loss_function", None) is loss


@contextmanager
def shared(model: nn.Module):
    """Within this block, ``record_forward(model)`` runs the forward once and gives every later ask that record.
    The model must not change inside it before its last question."""
    outer = _SHARED in model.__dict__
    if not outer:
        model.__dict__[_SHARED] = None
    try:
        yield
    finally:
        if not outer:
            model.__dict__.pop(_SHARED, None)


def record_forward(model: nn.Module, example: Optional[tuple] = None) -> ForwardRecord:
    """The model's forward, run once on meta and recorded (module docstring); ``example``: its positional
    arguments on meta instead of token ids (never shared)."""
    if example is None and model.__dict__.get(_SHARED) is not None:
        return model.__dict__[_SHARED]
    record = _record(model, example)
    if example is None and _SHARED in model.__dict__:
        model.__dict__[_SHARED] = record
    return record


def _record(model: nn.Module, example: Optional[tuple]) -> ForwardRecord:
    record = ForwardRecord()
    entries = record.entries
    for name, p in model.named_parameters():
        record.stand_ins[name] = torch.empty_like(p, device="meta").requires_grad_(p.requires_grad)
    for name, b in model.named_buffers():
        record.stand_ins[name] = torch.empty_like(b, device="meta")
    kwargs: dict = {}
    loss_probed = example is None and causal_lm(model)
    if example is not None:
        args = example
    elif loss_probed:
        tokens = trace_tokens(model)
        args = ()
        kwargs = {"input_ids": torch.zeros((1, tokens), dtype=torch.long, device="meta"),
                  "labels": torch.zeros((1, tokens), dtype=torch.long, device="meta")}
    else:
        args = token_arguments(model)
    record.inputs = tuple(t for t in (*args, kwargs.get("input_ids")) if isinstance(t, torch.Tensor))

    def loss_probe(*loss_args, **loss_kwargs):
        entries.append(("loss", loss_args, loss_kwargs))
        logits = loss_kwargs.get("logits", loss_args[0] if loss_args else None)
        return torch.zeros((), device=logits.device if isinstance(logits, torch.Tensor) else "cpu")

    def module_output(module, _args, out):
        entries.append(("module", module, out))

    handles = [m.register_forward_hook(module_output) for m in model.modules()]
    held = model.__dict__.get("_loss_function", _NONE)  # a loss_function set on the model: put back after
    if loss_probed:
        model.loss_function = loss_probe
    try:
        with FakeTensorMode(allow_non_fake_inputs=True), _Ops(entries), _Calls(entries):
            torch.func.functional_call(model, record.stand_ins, args=args, kwargs=kwargs, tie_weights=True,
                                       strict=False)
    except Exception as err:  # the model's own code: what stopped it is the answer
        record.error = (type(err).__name__, " ".join(str(err).split()))
    finally:
        for handle in handles:
            handle.remove()
        if loss_probed:
            del model._loss_function
            if held is not _NONE:
                model._loss_function = held
    return record
