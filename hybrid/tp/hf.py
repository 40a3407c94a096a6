"""Hugging Face models split by their own TP plan (``transformers``' ``tp_plan``), read without importing it.

A transformers model carries its plan in two places: the base model's in its config
(``config.base_model_tp_plan``: ``layers.*.self_attn.q_proj -> colwise``, ...; names relative to the base
model, the ``base_model_prefix`` attribute of a model with a head, e.g. ``model.``) and the head's in its class
(``LlamaForCausalLM._tp_plan = {"lm_head": "colwise_gather_output"}``). ``hf_plan(model)`` joins them as
transformers 5 does -- the base model's names prefixed, and the input embedding split by vocabulary
(``embed_tokens: embedding_rowwise``) when the base model's plan does not name it, so that a head tied to it
is split alike -- and maps the styles onto hybrid's (``hybrid.tp.plan``; ``colwise_gather_output`` is
``colwise_rep``: the head's logits gathered, so the model's own loss reads them whole).

What the config says about splitting (heads, MLP, vocabulary; ``largest_tp``) is ``hybrid.tp.hf_config``.
"""

from __future__ import annotations

from typing import Optional

from torch import nn

from hybrid.comm.collectives import Comm
from hybrid.errors import ConfigError
from hybrid.config.tp_plan import normalize_plan
from hybrid.tp.plan import apply_plan


def raw_hf_plan(model: nn.Module) -> Optional[dict]:
    """The model's own plan in transformers' spellings, names from the model (None: it has none)."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "base_model_tp_plan"):
        return None
    prefix_attr = getattr(model, "base_model_prefix", "") or ""
    base = getattr(model, prefix_attr, None) if prefix_attr else None
    if not isinstance(base, nn.Module) or base is model:
        base, prefix = model, ""
    else:
        prefix = prefix_attr + "."
    base_plan = dict(getattr(config, "base_model_tp_plan", None) or {})
    head_plan = dict(getattr(type(model), "_tp_plan", None) or {}) if base is not model else {}
    if not base_plan and not head_plan:
        return None
    if base_plan and "embed_tokens" not in base_plan and isinstance(getattr(base, "embed_tokens", None),
                                                                    nn.Embedding):
        base_plan = {"embed_tokens": "embedding_rowwise", **base_plan}
    return {**{prefix + pattern: style for pattern, style in base_plan.items()}, **head_plan}


def hf_plan(model: nn.Module) -> Optional[dict]:
    """The model's own TP plan in hybrid's styles (``hybrid.tp.plan``), or None for a model without one; a
    style hybrid does not implement is a ``ConfigError`` naming it."""
    raw = raw_hf_plan(model)
    return None if raw is None else normalize_plan(raw, own_plan_name(model))


def own_plan_name(model: nn.Module) -> str:
    return f"{type(model).__name__}'s own TP plan"


def parallelize(model: nn.Module, tp_comm: Optional[Comm], plan: Optional[dict] = None,
                where: str = "the TP plan") -> nn.Module:
    """Split ``model`` over ``tp_comm`` by ``plan`` (named ``where`` in errors), else by its own Hugging Face
    plan (``hf_plan``); returns it."""
    if plan is not None:
        return apply_plan(model, plan, tp_comm, where)
    own = hf_plan(model)
    if own is None:
        raise ConfigError(f"{type(model).__name__} has no TP plan of its own (no config.base_model_tp_plan); give "
                          "one: parallel.tp_plan in the cluster file, or hybrid.tp.apply_plan(model, plan, tp_comm).")
    return apply_plan(model, own, tp_comm, own_plan_name(model))
