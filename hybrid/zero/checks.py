"""What the ZeRO engine checks of the model and of each call, and the notes it logs (one sentence each).

At ``initialize`` (``ZeroEngine.__init__``): a model with complex or sparse-gradient parameters, a
``torch.compile``'d model where units are hooked, a model another stage-3 engine holds, or TP layers split
over another group than the ``tp_group`` given are refused; a model built in a third dtype, and bf16 on a CPU
without native bf16 matmul, are noted (once, on the first rank). At each ``engine.backward``: the loss must be
the scalar of a forward with gradients, and the trainable set must be the one the engine was built with.
"""

from __future__ import annotations

import logging
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from hybrid.comm.collectives import Comm
from hybrid.config.stage_policy import StagePolicy
from hybrid.errors import ConfigError, LossError, UsageError, listing
from hybrid.plan.cpu_bf16 import slow_bf16_note
from hybrid.weights.attrs import is_tensor_parallel
from hybrid.zero.params import wears_released_class
from hybrid.zero.tp_interface import split_over_tp

log = logging.getLogger("hybrid.zero.engine")  # the engine's notes, under the engine's name


def check_tp_degree(module: nn.Module, tp_comm: Optional[Comm]) -> None:
    """The model's TP layers must be split over the ``tp_group`` the engine got -- the same ranks, not only as
    many: with another group the gradient norm, the TP-replicated parameters and the checkpoint's slices would
    all silently go wrong (a model built over ``mesh.tp_comm`` with ``tp_group=mesh.dp_group`` trained on)."""
    tp = tp_comm.size if tp_comm is not None else 1
    fix = ("build the model with tp_comm=mesh.tp_comm (ctx.mesh.tp_comm under hybrid launch) and pass "
           "tp_group=mesh.tp_group, both of one mesh")
    for name, sub in split_over_tp(module):
        sub_tp, sub_comm = sub.tp_split()
        if sub_tp != tp:
            given = "no tp_group (or one of size 1)" if tp == 1 else f"a tp_group of size {tp}"
            raise ConfigError(f"{name or 'the model'} is a {type(sub).__name__} split over a TP group of size "
                              f"{sub_tp}, but hybrid.initialize got {given}: {fix}")
        if tp > 1 and _ranks_of(sub_comm) != _ranks_of(tp_comm):
            raise ConfigError(f"{name or 'the model'} is a {type(sub).__name__} split over the ranks "
                              f"{list(_ranks_of(sub_comm))}, but hybrid.initialize got a tp_group of the ranks "
                              f"{list(_ranks_of(tp_comm))}: {fix}")
    if tp > 1 and not any(is_tensor_parallel(p) for p in module.parameters()):
        raise ConfigError(f"hybrid.initialize got a tp_group of size {tp}, but the model has no tensor-parallel "
                          "parameters (hybrid.tp layers or mark_tensor_parallel), so every TP rank would train the "
                          "whole model: pass tp_group=None, build the model from hybrid.tp layers, or split it by a "
                          "TP plan first (ctx.parallelize(model), hybrid.tp.apply_plan)")


def _ranks_of(comm: Optional[Comm]) -> tuple:
    """The global ranks of ``comm``'s group (the default group for None)."""
    group = comm.group if comm is not None and comm.group is not None else dist.group.WORLD
    return tuple(dist.get_process_group_ranks(group))


def check_trainable_unchanged(names, params, frozen) -> None:
    """The trainable set is fixed at initialize: a parameter frozen afterwards would still be stepped with a
    zero gradient (Adam momentum and weight decay keep moving it), silently unlike torch's optimizers, and one
    unfrozen afterwards would never be stepped (its gradient neither reduced nor applied)."""
    changed = [n for n, p in zip(names, params) if not p.requires_grad]
    if changed:
        raise UsageError(f"{_subject(changed)} frozen after hybrid.initialize; the engine would keep updating "
                         f"{'them' if len(changed) > 1 else 'it'}. Freeze parameters (requires_grad_(False)) "
                         "before hybrid.initialize")
    changed = [n for n, p in frozen if p.requires_grad]
    if changed:
        raise UsageError(f"{_subject(changed)} unfrozen after hybrid.initialize; the engine would never update "
                         f"{'them' if len(changed) > 1 else 'it'}. Set requires_grad before hybrid.initialize "
                         "(to unfreeze mid-training, save a checkpoint and initialize a new engine)")


def _subject(names: list) -> str:
    return f"{len(names)} parameter(s) ({listing(names, 3)}) {'were' if len(names) > 1 else 'was'}"


def note_cast(module: nn.Module, dtype: torch.dtype) -> None:
    """The module runs in the config's precision (fp32 masters either way): say so (once, on the first rank)
    where the model was built in a third dtype, whose inputs the user may still be making in it."""
    odd = sorted({str(p.dtype).replace("torch.", "") for p in module.parameters()
                  if p.is_floating_point() and p.dtype not in (torch.float32, dtype)})
    if odd and (not dist.is_initialized() or dist.get_rank() == 0):
        name = str(dtype).replace("torch.", "")
        log.warning("the model's parameters are %s; hybrid runs the module in %s, the config's precision "
                    "(bf16: {\"enabled\": true} selects bf16), so give it %s inputs", " and ".join(odd), name, name)


def note_slow_bf16(device: torch.device, dtype: torch.dtype) -> None:
    """bf16 on a CPU without native bf16 matmul is ~100x slower than fp32: say so (once, on the first rank)."""
    if dtype == torch.bfloat16 and (not dist.is_initialized() or dist.get_rank() == 0):
        note = slow_bf16_note(device)
        if note is not None:
            log.warning("%s", note)


def refuse_complex(named) -> None:
    """Complex parameters would be stored as real numbers (their imaginary part dropped)."""
    bad = [n for n, p in named if p.is_complex()]
    if bad:
        raise ConfigError(f"{_subject(bad)} complex; hybrid trains real floating-point parameters, and would drop "
                          "the imaginary part: keep each as a real parameter of torch.view_as_real's shape and "
                          "torch.view_as_complex it in the forward")


def refuse_model_of_a_stage3_engine(module: nn.Module) -> None:
    """A model a stage-3 engine holds has its parameters sharded there (released between forwards) and that
    engine's hooks on its modules: a second engine cannot take it over."""
    if any(wears_released_class(p) for p in module.parameters()):
        raise UsageError("this model is already initialized by a ZeRO stage-3 engine, which holds its parameters "
                         "in shards; build a new model to initialize again (or keep training with that engine)")


def refuse_compiled_with_unit_hooks(module: nn.Module, policy: StagePolicy) -> None:
    """Where the parameters are sharded (stage 3) every unit root is hooked; inside a graph ``torch.compile``
    traced before the hooks existed, dynamo fails on them with an internal error."""
    if policy.shard_params and hasattr(module, "_orig_mod") and type(module).__name__ == "OptimizedModule":
        raise ConfigError("hybrid.initialize got a torch.compile'd model at ZeRO stage 3, whose unit hooks a "
                          "compiled graph cannot take: pass the plain model and compile engine.module (or its "
                          "blocks) after hybrid.initialize")


def check_loss(loss) -> None:
    """``engine.backward`` takes the one-element loss of a forward that recorded gradients."""
    if isinstance(loss, torch.Tensor) and loss.numel() == 1 and loss.requires_grad:
        return
    what = (f"a {type(loss).__name__}" if not isinstance(loss, torch.Tensor)
            else f"a tensor of shape {tuple(loss.shape)}" if loss.numel() != 1
            else "a tensor that does not require grad (computed under torch.no_grad() or from frozen parameters?)")
    raise LossError(f"engine.backward(loss) needs the scalar loss of a forward run with gradients, got {what}; "
                    "pass output.loss for a Hugging Face output (with labels= given to the forward), or reduce "
                    "the loss to one element (loss.mean())")


def refuse_sparse_gradients(module: nn.Module) -> None:
    """The engine reduces dense gradients; an embedding with ``sparse=True`` would hand it sparse ones."""
    for name, sub in module.named_modules():
        if isinstance(sub, (nn.Embedding, nn.EmbeddingBag)) and sub.sparse and sub.weight.requires_grad:
            where = f"module {name!r}" if name else "the model"
            raise ConfigError(f"{where} is an {type(sub).__name__} with sparse=True, whose gradients are sparse; "
                              f"the ZeRO engine reduces dense gradients: build it with sparse=False")
