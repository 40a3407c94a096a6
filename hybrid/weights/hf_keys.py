"""The names a transformers model's tensors have in a checkpoint, as transformers itself writes and reads them.

A model's state-dict names (its modules' names) are not always its checkpoints' keys: transformers renames
keys on load and back on save (GPT-NeoX's head module is ``lm_head``, every Pythia checkpoint holds
``embed_out.weight``; a checkpoint of the base model loads into a ``...ForCausalLM`` with the base-model
prefix added; legacy ``LayerNorm.gamma`` is ``LayerNorm.weight``). Both directions are asked of the
installed transformers' own conversion machinery for that model (``conversion_mapping``'s
``get_model_conversion_mapping``, ``core_model_loading``'s ``rename_source_key``); nothing here knows a
rename of its own:

- ``model_names(model, keys, where)``: each checkpoint key -> the state-dict name ``from_pretrained`` loads it
  into (its renamings, then the base-model prefix added or dropped where the model has the result). A key
  transformers would *convert* (merge, split, transpose: a ``WeightConverter``, e.g. Mixtral's per-expert
  tensors fused into one) is not a rename: one ``CheckpointError`` sentence naming the key and ``where`` (the
  file), and so is a second key loading into a name already taken.
- ``checkpoint_keys(model, names)``: each state-dict name -> the key ``save_pretrained`` writes it under (the
  model's conversions reversed: the ones ``from_pretrained`` recorded on it, else its default ones without
  the legacy renames and prefix changes, as ``save_pretrained`` chooses). When transformers would convert any
  of ``names`` rather than rename it, every name is its own: what ``save_pretrained(...,
  save_original_format=False)`` writes, which ``from_pretrained`` loads as it is (a mix of the two layouts is
  one transformers never writes).

For a model that is not a transformers ``PreTrainedModel``, or without transformers' conversion machinery
(before transformers 5), both are the identity. transformers is imported only when the model is one of its
models (it is then imported already), so ``hybrid.weights`` imports without it.
"""

from __future__ import annotations

import sys
from typing import Iterable, Optional

from torch import nn

from hybrid.errors import CheckpointError


def _pretrained(model: nn.Module) -> bool:
    """Whether ``model`` is a transformers ``PreTrainedModel`` (without importing transformers)."""
    modeling = sys.modules.get("transformers.modeling_utils")
    return modeling is not None and isinstance(model, modeling.PreTrainedModel)


def _machinery():
    """transformers' conversion functions and classes, or None where the installed version has none."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import (PrefixChange, WeightConverter, WeightRenaming, dot_natural_key,
                                                     rename_source_key)
    except ImportError:
        return None
    return get_model_conversion_mapping, PrefixChange, WeightConverter, WeightRenaming, dot_natural_key, \
        rename_source_key


def _split(transforms: list, machinery) -> tuple[list, list]:
    """(renamings, converters) of ``transforms``, in their order, as transformers applies them."""
    _, _, converter, renaming, _, _ = machinery
    return ([t for t in transforms if isinstance(t, renaming)], [t for t in transforms if isinstance(t, converter)])


def _operations(converters: list, pattern: str) -> str:
    """The operations of the converter whose source pattern ``pattern`` is, by class name."""
    for c in converters:
        if pattern in c.source_patterns:
            return ", ".join(type(op).__name__ for op in getattr(c, "operations", ())) or type(c).__name__
    return "a conversion"


def model_names(model: nn.Module, keys: Iterable[str], where: str = "the checkpoint") -> dict[str, str]:
    """Checkpoint key -> the state-dict name of ``model`` that ``from_pretrained`` loads it into (itself where
    nothing renames it); ``where`` names the file in the sentence of a key that is converted, not renamed."""
    keys = list(keys)
    machinery = _machinery() if _pretrained(model) else None
    if machinery is None:
        return {k: k for k in keys}
    get_mapping, _, _, _, natural, rename = machinery
    renamings, converters = _split(get_mapping(model), machinery)  # fresh transforms: some keep state per load
    own = dict.fromkeys(model.state_dict(keep_vars=True), True)
    prefix = model.base_model_prefix
    out: dict = {}
    taken: dict = {}  # model name -> the key loading into it
    for key in sorted(keys, key=natural):  # the order from_pretrained renames in (a group rename keys on it)
        name, converted = rename(key, renamings, converters, prefix, own)
        if name not in own and key in own:  # renamed away from a name the model has: only the prefix changes
            name, converted = rename(key, [], [], prefix, own)
        if converted is not None:
            raise CheckpointError(f"{where} holds {key!r}, which transformers loads into {name!r} by converting it "
                                  f"({_operations(converters, converted)}), not by a rename, so its ranges cannot be "
                                  f"read; load it once with from_pretrained and save it with save_pretrained(DIR, "
                                  f"save_original_format=False), then give DIR.")
        if name in taken:
            raise CheckpointError(f"{where} holds both {taken[name]!r} and {key!r}, which transformers loads as the "
                                  f"same tensor {name!r}; keep one of them (save the model again with "
                                  f"save_pretrained).")
        taken[name] = key
        out[key] = name
    return out


def checkpoint_keys(model: nn.Module, names: Optional[Iterable[str]] = None) -> dict[str, str]:
    """State-dict name (each of ``names``, default all of ``model``'s) -> the key ``save_pretrained`` writes it
    under; every name its own when transformers would convert one of them (see the module docstring)."""
    names = list(model.state_dict(keep_vars=True) if names is None else names)
    machinery = _machinery() if _pretrained(model) else None
    if machinery is None:
        return {n: n for n in names}
    get_mapping, prefix_change, _, _, natural, rename = machinery
    used = getattr(model, "_weight_conversions", None)  # recorded by from_pretrained: what its checkpoint had
    if used is None:  # a model built from its config: its defaults, as save_pretrained reverts them
        used = [t for t in get_mapping(model, add_legacy=False) if not isinstance(t, prefix_change)]
    renamings, converters = _split([t.reverse_transform() for t in reversed(used)], machinery)
    out: dict = {}
    for name in sorted(names, key=natural):
        key, converted = rename(name, renamings, converters, reverse=True)
        if converted is not None:
            return {n: n for n in names}
        out[name] = key
    return {n: out[n] for n in names}
