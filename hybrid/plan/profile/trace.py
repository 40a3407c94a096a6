"""One micro-step of a model on fake tensors, and what torch counts of it (``run_once``).

The model runs as it is (its block list already cut by the caller) under ``FakeTensorMode`` over meta stand-ins
of every parameter and buffer (``torch.func.functional_call``: nothing allocated), forward and backward in one
call so the stand-ins are in place when a checkpoint recomputes a block. Counted:

- FLOPs of forward and of backward: ``FlopCounterMode`` (with the CPU flash kernel counted as torch counts the
  other fused attention kernels);
- bytes saved for backward: ``saved_tensors_hooks``, each storage once, the stand-ins (and views of them) left
  out; with ``checkpointing``, a checkpointed block's inputs, which the checkpoint keeps (its own hooks hide
  the rest); apart, the head's: what is saved from the head on (its input, the loss's) and its output; and,
  of all of them, the *whole* ones: storages first saved as one vector per token (``(b, s, width)`` or
  ``(b·s, width)``) of the width of the blocks' input (the residual stream: norms, residual sums, a
  row-parallel projection's input), which stay whole on every TP rank where the rest of a block is split;
- aten ops: a ``TorchDispatchMode``, less ``detach`` (bookkeeping, and fake tensors' gradient accumulation
  adds detaches an eager step does not), a fake tensor's own ``prim`` queries and ``FusedAttention``'s moves.

``FusedAttention`` computes ``scaled_dot_product_attention`` of meta tensors on fake CPU tensors, so torch
picks its CPU kernel (fused flash: O(s) saved) rather than the math path it takes on meta. What stops the run
is ``ProfileError``: one sentence naming the op it came through and the exception.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.multiprocessing.reductions import StorageWeakRef
from torch.overrides import TorchFunctionMode
from torch.utils.checkpoint import CheckpointError, checkpoint
from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from hybrid.errors import ConfigError, first_line

aten = torch.ops.aten
DEVICE = "meta"
# What a failing op usually means, for the sentence.
_HINTS = {"_local_scalar_dense": "a tensor's value read in Python: .item(), bool(), .tolist()",
          "nonzero": "an output whose shape depends on values"}


class ProfileError(ConfigError):
    """The model's profile could not be taken; the message names the op and the exception."""


def _cpu_flash(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
    return sdpa_flop_count(query_shape, key_shape, value_shape)


def _cpu_flash_backward(grad_out_shape, query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
    return sdpa_backward_flop_count(grad_out_shape, query_shape, key_shape, value_shape)


FLOP_FORMULAS = {aten._scaled_dot_product_flash_attention_for_cpu: _cpu_flash,
                 aten._scaled_dot_product_flash_attention_for_cpu_backward: _cpu_flash_backward}
_MOVES = (torch.device("cpu"), torch.device(DEVICE))


def storage(t: torch.Tensor) -> StorageWeakRef:
    return StorageWeakRef(t.untyped_storage())


class OpCounter(TorchDispatchMode):
    """Counts the aten ops of forward and backward (module docstring); remembers the op an exception came
    through."""

    def __init__(self):
        super().__init__()
        self.count, self.failed = 0, None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace != "prim" and func is not aten.detach.default and \
                (func is not aten._to_copy.default or kwargs.get("device") not in _MOVES):
            self.count += 1
        try:
            return func(*args, **kwargs)
        except Exception:
            if self.failed is None:
                self.failed = func
            raise


class FusedAttention(TorchFunctionMode):
    """SDPA of meta tensors on fake CPU tensors (module docstring); ``alias`` maps each moved copy's storage to
    its original's (and that one's bytes: q, k and v may be views of one projection's output), so a tensor
    saved under both names counts once, as the whole storage it keeps."""

    def __init__(self, alias: Optional[dict] = None):
        super().__init__()
        self.alias = {} if alias is None else alias

    def _moved(self, t, device):
        if not isinstance(t, torch.Tensor) or t.device.type == device:
            return t
        moved = t.to(device)
        self.alias[storage(moved)] = self.alias.get(storage(t), (storage(t), t.untyped_storage().nbytes()))
        return moved

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not F.scaled_dot_product_attention or not args or args[0].device.type != DEVICE:
            return func(*args, **kwargs)
        out = func(*(self._moved(a, "cpu") for a in args), **{k: self._moved(a, "cpu") for k, a in kwargs.items()})
        return self._moved(out, DEVICE)


class Recompute:
    """``torch.utils.checkpoint``'s ``context_fn``: the recompute takes the attention kernel its forward took
    (torch function modes do not reach a recompute in backward). ``alias``: the current run's, or None."""

    def __init__(self):
        self.alias = None

    def __call__(self):
        return contextlib.nullcontext(), (FusedAttention(self.alias) if self.alias is not None
                                          else contextlib.nullcontext())


class Checkpointed(nn.Module):
    """A block run under ``torch.utils.checkpoint`` (non-reentrant)."""

    def __init__(self, block: nn.Module, context_fn: Callable):
        super().__init__()
        self.block, self.context_fn = block, context_fn

    def forward(self, *args, **kwargs):
        return checkpoint(self.block, *args, use_reentrant=False, context_fn=self.context_fn, **kwargs)


@dataclass
class Counts:
    forward_flops: int = 0
    backward_flops: int = 0
    saved: int = 0   # bytes saved for backward, the head's output included
    whole: int = 0   # of them: storages first saved with the blocks' input width as their last dimension
    head: int = 0    # of them: what is saved from the head on (its input, the loss's) and its output
    ops: int = 0
    width: int = 0   # the last dimension of the first block's input (0: no blocks)


class _Step(nn.Module):
    """Forward and backward in one call (module docstring)."""

    def __init__(self, model: nn.Module, modes: tuple, pack: Callable, state: dict):
        super().__init__()
        self.model, self.modes, self.pack, self.state = model, modes, pack, state

    def _modes(self, stack):
        for mode in self.modes:
            stack.enter_context(mode)

    def forward(self, *args, **kwargs):
        counter = FlopCounterMode(display=False, custom_mapping=FLOP_FORMULAS)
        with counter, contextlib.ExitStack() as stack:
            self._modes(stack)
            stack.enter_context(torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t))
            loss = _loss(self.model(*args, **kwargs))
        self.state.update(forward=False, forward_flops=counter.get_total_flops())
        counter = FlopCounterMode(display=False, custom_mapping=FLOP_FORMULAS)
        with counter, contextlib.ExitStack() as stack:
            self._modes(stack)
            loss.backward()
        self.state["backward_flops"] = counter.get_total_flops()


def _loss(out) -> torch.Tensor:
    """The model's loss (a transformers output's ``loss``), else the first tensor it returned that needs a
    gradient, summed."""
    loss = getattr(out, "loss", None)
    if loss is None:
        tensors = [t for t in tree_leaves(out.to_tuple() if hasattr(out, "to_tuple") else out)
                   if isinstance(t, torch.Tensor) and t.requires_grad]
        if not tensors:
            raise ProfileError("the profile could not be taken: the model's forward returned no tensor that "
                               "needs a gradient; return the loss (or the logits) from forward.")
        loss = tensors[0]
    return loss if loss.dim() == 0 else loss.sum()


def run_once(model: nn.Module, arguments: Callable, batch: int, seq: int, *, attention: str, dtype, checkpointing: bool,
             blocks: Optional[nn.ModuleList], head: Optional[nn.Module], recompute: Recompute) -> Counts:
    """One forward and backward of ``model`` as it is now (module docstring). ``arguments(batch, seq, device)``:
    the forward's arguments (a tuple, or a dict of keyword arguments); ``blocks``: the (cut) block list, whose
    inputs a checkpoint keeps; ``head``: the module whose output is the logits."""
    ops, fused = OpCounter(), FusedAttention()
    modes = (ops, fused) if attention == "fused" else (ops,)
    recompute.alias = fused.alias if attention == "fused" else None
    seen, head_seen, whole, excluded = {}, {}, {}, set()
    state = {"forward": True, "head": False, "width": None}

    def count(t, into_head=False):
        if not isinstance(t, torch.Tensor):
            return
        ref, size = fused.alias.get(storage(t), (storage(t), t.untyped_storage().nbytes()))
        if ref in excluded:
            return
        width = state["width"]
        if ref not in seen and width and tuple(t.shape) in ((batch, seq, width), (batch * seq, width)):
            whole[ref] = size
        seen.setdefault(ref, size)
        if into_head or state["head"]:
            head_seen.setdefault(ref, size)

    def pack(t):
        if state["forward"]:
            count(t)
        return t

    def block_inputs(module, args, kwargs):  # the residual stream's width; what a checkpointed block keeps: its inputs
        if state["width"] is None:
            state["width"] = next((t.shape[-1] for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)
                                   and t.is_floating_point() and t.dim() >= 2), None)
        if state["forward"] and checkpointing:
            for t in tree_leaves((args, kwargs)):
                count(t)

    def head_start(module, args):
        state["head"] = True

    def head_output(module, args, out):
        for t in tree_leaves(out):
            count(t, into_head=True)

    handles = []
    for block in blocks if blocks is not None else ():
        inner = block.block if isinstance(block, Checkpointed) else block
        handles.append(inner.register_forward_pre_hook(block_inputs, with_kwargs=True))
    if head is not None:
        handles += [head.register_forward_pre_hook(head_start), head.register_forward_hook(head_output)]
    try:
        with FakeTensorMode(allow_non_fake_inputs=True):
            stand_ins = {}
            for name, t in list(model.named_parameters()) + list(model.named_buffers()):
                kind = dtype if dtype is not None and t.is_floating_point() else t.dtype
                stand_ins[f"model.{name}"] = torch.empty(t.shape, dtype=kind, device=DEVICE).requires_grad_(
                    t.requires_grad and isinstance(t, nn.Parameter))
            excluded.update(storage(t) for t in stand_ins.values())
            made = arguments(batch, seq, DEVICE)
            args, kwargs = ((), dict(made)) if isinstance(made, dict) else (tuple(made), {})
            torch.func.functional_call(_Step(model, modes, pack, state), stand_ins, args=args, kwargs=kwargs,
                                       tie_weights=True, strict=False)
    except ProfileError:
        raise
    except Exception as err:  # the model's own code: what stopped it is the answer, in one sentence
        raise ProfileError(_sentence(model, ops.failed, err)) from err
    finally:
        for handle in handles:
            handle.remove()
    return Counts(state["forward_flops"], state["backward_flops"], sum(seen.values()), sum(whole.values()),
                  sum(head_seen.values()), ops.count, state["width"] or 0)


def _sentence(model: nn.Module, op, err: Exception) -> str:
    name = type(model).__name__
    if isinstance(err, CheckpointError):  # its recompute ran SDPA on meta: the math path, not the forward's kernel
        return (f"the profile of {name} could not be taken: it checkpoints its blocks itself and its recompute "
                f"took another attention kernel than its forward ({first_line(err, limit=120)}); build it without "
                "its own activation checkpointing and profile it with checkpointing=True, or with attention='math'.")
    where = f" at {op}" if op is not None else ""
    hint = _HINTS.get(getattr(op, "__name__", "").split(".")[0]) if op is not None else None
    reason = f" ({hint})" if hint else ""
    return (f"the profile of {name} could not be taken: its step stopped{where}{reason} with "
            f"{type(err).__name__}: {first_line(err, limit=200)}; a forward that reads tensor values or an op "
            "without a fake (meta) kernel cannot be profiled without data: keep such reads out of the training "
            "forward, or register the op's fake kernel (torch.library.register_fake).")
