"""``profile_model`` and ``profile_config``: a model's blocks found, cut to one and two, run, and fitted.

See ``hybrid.plan.profile`` for the contract. The model is left as it was: its block list, training mode,
activation checkpointing and attention implementation are put back, whatever happens.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
from typing import Callable, Optional

import torch
from torch import nn

from hybrid.errors import ConfigError
from hybrid.plan.profile.figures import ModelProfile, Part, Scaling
from hybrid.plan.profile.trace import Checkpointed, Recompute, run_once

TARGET_NAMES = ("targets", "labels", "target")
UNMASKED_SDPA = "hybrid_profile_unmasked_sdpa"
ATTENTION = ("fused", "math")


def find_blocks(model: nn.Module, name: Optional[str] = None) -> tuple:
    """``(qualified name, ModuleList)`` of the model's blocks: ``name``'s, else the longest ``nn.ModuleList``
    whose modules are all of one class (more parameters break a tie); ``('', None)`` where there is none."""
    if name is not None:
        try:
            found = model.get_submodule(name)
        except AttributeError:
            found = None
        if not isinstance(found, nn.ModuleList):
            raise ConfigError(f"blocks={name!r} is not an nn.ModuleList of {type(model).__name__}; name the "
                              "model's list of repeated blocks (as named_modules() names it).")
        return name, found
    best, key = ("", None), (0, 0)
    for qualified, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and len(module) and len({type(m) for m in module}) == 1:
            rank = (len(module), sum(p.numel() for p in module.parameters()))
            if rank > key:
                best, key = (qualified, module), rank
    return best


def is_transformers(model: nn.Module) -> bool:
    return any(c.__name__ == "PreTrainedModel" and c.__module__.startswith("transformers.") for c in type(model).__mro__)


def output_head(model: nn.Module, blocks: Optional[nn.ModuleList]) -> Optional[nn.Module]:
    """A transformers model's output embedding; else the last module with parameters of its own, outside the
    blocks and not an embedding (modules register in the order most models call them)."""
    getter = getattr(model, "get_output_embeddings", None)
    head = getter() if callable(getter) else None
    if isinstance(head, nn.Module):
        return head
    inside = {id(m) for m in blocks.modules()} if blocks is not None else set()
    leaves = [m for m in model.modules() if id(m) not in inside and not isinstance(m, nn.Embedding)
              and any(True for _ in m.parameters(recurse=False))]
    return leaves[-1] if leaves else None


def token_example(model: nn.Module, hf: bool) -> Callable:
    """Token ids for the forward's first argument, and for its ``targets``/``labels``/``target`` when it takes
    one; a transformers model's ``input_ids`` and ``labels``, without a cache."""
    try:
        names = list(inspect.signature(model.forward).parameters)
    except (TypeError, ValueError):
        names = []
    targets = next((n for n in TARGET_NAMES if n in names[1:]), None)

    def example(batch: int, seq: int, device: str):
        ids = torch.zeros((batch, seq), dtype=torch.long, device=device)
        if hf:
            return {"input_ids": ids, "labels": ids, "use_cache": False}
        return {names[0]: ids, targets: ids} if targets else (ids,)
    return example


@contextlib.contextmanager
def _unmasked(model: nn.Module):
    """A transformers model with ``sdpa`` attention runs it without a mask, as a training step on unpadded,
    unpacked windows does: under fake tensors transformers cannot check for padding or packing and would build
    an s² mask that the real step skips. Its attention is registered under a name transformers' mask builders do
    not know (``AttentionInterface``, transformers' own extension point), so they build none."""
    config = getattr(model, "config", None)
    if getattr(config, "_attn_implementation", None) != "sdpa":
        yield
        return
    from transformers import AttentionInterface

    AttentionInterface.register(UNMASKED_SDPA, AttentionInterface._global_mapping["sdpa"])
    config._attn_implementation = UNMASKED_SDPA
    try:
        yield
    finally:
        config._attn_implementation = "sdpa"


@contextlib.contextmanager
def _own_checkpointing(model: nn.Module, on: bool, context_fn: Callable):
    """A transformers model's own activation checkpointing on (non-reentrant, ``context_fn``) or off; afterwards
    each module's switch and function, and the input-grads hook, as they were."""
    before = [(m, m.gradient_checkpointing, m.__dict__.get("_gradient_checkpointing_func"))
              for m in model.modules() if hasattr(m, "gradient_checkpointing")]
    had_hook = hasattr(model, "_require_grads_hook")
    try:
        if on:
            enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
            enable({"use_reentrant": False, "context_fn": context_fn})
        else:
            for m, _, _ in before:
                m.gradient_checkpointing = False
        yield
    finally:
        for m, flag, func in before:
            m.gradient_checkpointing = flag
            if func is None:
                m.__dict__.pop("_gradient_checkpointing_func", None)
            else:
                m._gradient_checkpointing_func = func
        if not had_hook and hasattr(model, "_require_grads_hook"):
            model.disable_input_require_grads()


def profile_model(model: nn.Module, batch: int, seq: int, *, example: Optional[Callable] = None,
                  checkpointing: bool = False, blocks: Optional[str] = None, layers: Optional[int] = None,
                  dtype: Optional[torch.dtype] = None, attention: str = "fused") -> ModelProfile:
    """The profile of ``model`` (built on meta, or anywhere: its values are never read) measured at micro-batch
    ``batch`` and sequences ``seq`` and ``seq // 2``. ``example(batch, seq, device)``: the forward's arguments
    on ``device`` (a tuple, or a dict of keyword arguments); ``checkpointing``: each block recomputed in
    backward; ``blocks``: the block list's qualified name; ``layers``: blocks in the full model (default: the
    list's length); ``dtype``: the compute dtype (default: the parameters'); ``attention``: "fused" or "math".
    Raises ``ProfileError`` where the step cannot run on fake tensors."""
    if attention not in ATTENTION:
        raise ConfigError(f"attention must be 'fused' or 'math', got {attention!r}.")
    if not (isinstance(batch, int) and batch >= 1 and isinstance(seq, int) and seq >= 2):
        raise ConfigError(f"the profile needs a whole batch >= 1 and seq >= 2, got batch={batch!r}, seq={seq!r}.")
    hf = is_transformers(model)
    name, found = find_blocks(model, blocks)
    full = len(found) if found is not None else 0
    layers = full if layers is None else layers
    counts = (1, 2) if full >= 2 else (0, full)  # the block counts run: one block is their difference
    parent = model.get_submodule(name.rpartition(".")[0]) if name else None
    attr = name.rpartition(".")[2]
    arguments = example or token_example(model, hf)
    head = output_head(model, found)
    own = hf and getattr(model, "supports_gradient_checkpointing", False)
    recompute = Recompute()
    seqs = (seq, seq // 2)
    runs = {}
    training = model.training
    try:
        model.train()
        with _own_checkpointing(model, checkpointing, recompute) if own else contextlib.nullcontext(), \
                _unmasked(model) if hf else contextlib.nullcontext():
            for k in counts:
                cut = None
                if parent is not None:
                    kept = list(found)[:k]
                    if checkpointing and not own:
                        kept = [Checkpointed(m, recompute) for m in kept]
                    cut = parent._modules[attr] = nn.ModuleList(kept)
                for s in seqs:
                    runs[k, s] = run_once(model, arguments, batch, s, attention=attention, dtype=dtype,
                                          checkpointing=checkpointing, blocks=cut, head=head, recompute=recompute)
    finally:
        if parent is not None:
            parent._modules[attr] = found
        model.train(training)

    lo, hi = counts

    def split(field: str, s: int) -> tuple:  # (one block, outside)
        a, b = getattr(runs[lo, s], field), getattr(runs[hi, s], field)
        per_block = b - a if hi > lo else 0
        return per_block, a - lo * per_block

    def fitted(field: str, which: int) -> Scaling:
        return Scaling.fit(batch, seqs, tuple(split(field, s)[which] for s in seqs))

    block, outside = (Part(fitted("forward_flops", i), fitted("backward_flops", i), fitted("saved", i),
                           split("ops", seq)[i], fitted("whole", i)) for i in (0, 1))
    head_bytes = Scaling.fit(batch, seqs, tuple(runs[lo, s].head for s in seqs))
    block_params = sum(p.numel() for p in found[0].parameters()) if full else 0
    params = sum(p.numel() for p in model.parameters()) + (layers - full) * block_params
    block_tensors = sum(1 for _ in found[0].parameters()) if full else 0
    tensors = sum(1 for _ in model.parameters()) + (layers - full) * block_tensors
    width = runs[hi, seq].width
    kind = dtype or next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    return ModelProfile(type(model).__name__, params, layers, name, block, outside, head_bytes, checkpointing,
                        str(kind).removeprefix("torch."), attention, tuple((batch, s) for s in seqs), width,
                        tensors)


def profile_config(config, batch: int, seq: int, *, layers_run: int = 2, **options) -> ModelProfile:
    """The profile of a transformers config's causal LM (``AutoModelForCausalLM``), built on meta with
    ``layers_run`` layers from a copy of ``config`` and scaled to its ``num_hidden_layers``; ``options`` as
    ``profile_model``'s."""
    return profile_model(model_on_meta(config, layers_run), batch, seq, layers=config.num_hidden_layers, **options)


def model_on_meta(config, layers: int = 2) -> nn.Module:
    """A transformers config's causal LM (``AutoModelForCausalLM``) on meta, built from a copy of ``config`` with
    at most ``layers`` layers (its per-layer ``layer_types`` cut alike)."""
    import transformers

    small = copy.deepcopy(config)
    small.num_hidden_layers = min(layers, config.num_hidden_layers)
    if isinstance(getattr(small, "layer_types", None), list):
        small.layer_types = small.layer_types[:small.num_hidden_layers]
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(small)
