"""Hugging Face models split by their own TP plan (``transformers``' ``tp_plan``), read without importing it.

A transformers model carries its plan in two places: the base model's in its config
(``config.base_model_tp_plan``: ``layers.*.self_attn.q_proj -> colwise``, ...; names relative to the base
model, the ``base_model_prefix`` attribute of a model with a head, e.g. ``model.``) and the head's in its class
(``LlamaForCausalLM._tp_plan = {"lm_head": "colwise_gather_output"}``). ``hf_plan(model)`` joins them as
transformers 5 does -- the base model's names prefixed, and the input embedding split by vocabulary
(``embed_tokens: embedding_rowwise``) when the base model's plan does not name it, so that a head tied to it
is split alike -- and maps the styles onto hybrid's (``hybrid.tp.plan``; ``colwise_gather_output`` is
``colwise_rep``: the head's logits gathered, so the model's own loss reads them whole).

``heads_refusal(config, tp)``: attention splits by whole heads, so ``num_attention_heads`` and
``num_key_value_heads`` must divide by ``tp``; ``config_refusal`` adds the MLP's ``intermediate_size`` and
the vocabulary, and ``largest_tp(config, gpus_per_node)`` is the largest degree dividing the node that
splits them all (what ``tp: auto`` picks for such a model).
"""

from __future__ import annotations

from typing import Any, Optional

from torch import nn

from hybrid.comm.collectives import Comm
from hybrid.errors import ConfigError
from hybrid.config.tp_plan import normalize_plan
from hybrid.tp.plan import apply_plan


def text_config(config: Any) -> Any:
    """The language model's config (a multimodal config's text part), or ``config`` itself."""
    get = getattr(config, "get_text_config", None)
    try:
        return get() if callable(get) else config
    except Exception:  # an older or unusual config: its own fields
        return config


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


def _field(config: Any, *names: str) -> Optional[int]:
    for name in names:
        value = getattr(config, name, None)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


def heads_refusal(config: Any, tp: int) -> Optional[str]:
    """Why attention of ``config`` cannot be split ``tp`` ways (heads not divisible), or None."""
    if config is None:
        return None
    config = text_config(config)
    heads = _field(config, "num_attention_heads", "n_head", "num_heads")
    kv = _field(config, "num_key_value_heads", "num_kv_heads") or heads
    name = type(config).__name__
    for field, value in (("num_attention_heads", heads), ("num_key_value_heads", kv)):
        if value is not None and value % tp:
            return (f"{name}.{field} is {value}, which tp={tp} does not divide (attention is split by whole "
                    f"heads); use a TP degree that divides {value}")
    return None


def config_refusal(config: Any, tp: int) -> Optional[str]:
    """``heads_refusal``, then the MLP's ``intermediate_size`` and the ``vocab_size``."""
    refusal = heads_refusal(config, tp)
    if refusal is not None:
        return refusal
    config = text_config(config)
    for field in ("intermediate_size", "vocab_size"):
        value = _field(config, field)
        if value is not None and value % tp:
            return (f"{type(config).__name__}.{field} is {value}, which tp={tp} does not divide; use a TP degree "
                    f"that divides {value}")
    return None


def largest_tp(config: Any, gpus_per_node: int) -> int:
    """The largest divisor of ``gpus_per_node`` that splits ``config``'s heads, KV heads, MLP and vocabulary."""
    return next(tp for tp in range(gpus_per_node, 0, -1)
                if gpus_per_node % tp == 0 and config_refusal(config, tp) is None)
