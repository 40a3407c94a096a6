"""Hugging Face models split by their own TP plan (``transformers``' ``tp_plan``), read without importing it.

A transformers model carries its plan in two places: the base model's in its config
(``config.base_model_tp_plan``: ``layers.*.self_attn.q_proj -> colwise``, ...; names relative to the base
model, the ``base_model_prefix`` attribute of a model with a head, e.g. ``model.``) and the head's in its class
(``LlamaForCausalLM._tp_plan = {"lm_head": "colwise_gather_output"}``). ``hf_plan(model)`` joins them as
transformers 5 does -- the base model's names prefixed, and the input embedding split by vocabulary
(``embed_tokens: embedding_rowwise``) when the base model's plan does not name it, so that a head tied to it
is split alike -- and maps the styles onto hybrid's (``hybrid.tp.plan``; ``colwise_gather_output`` is
``colwise_rep``: the head's logits gathered, so the model's own loss reads them whole).

What hybrid does beyond the plan's words is said in its ``notes`` (``plan_notes`` after ``apply_plan``): the
input embedding is split only when its forward goes through ``nn.Embedding``'s (Gemma's scaled embedding is,
around its scale), else left whole with a head tied to it; a mixture-of-experts model (an ``experts`` module, or
``num_local_experts`` / ``num_experts`` / ``n_routed_experts`` above 1) is not split: its plan is refused in one
sentence, and the launcher plans it at TP 1, its experts sharded by ZeRO, until expert parallelism exists.

What the config says about splitting (heads, MLP, vocabulary; ``largest_tp``) is ``hybrid.tp.hf_config``.
"""

from __future__ import annotations

from typing import Optional

from torch import nn

from hybrid.comm.collectives import Comm
from hybrid.errors import ConfigError
from hybrid.config.tp_plan import normalize_plan
from hybrid.tp.hf_config import text_config
from hybrid.tp.plan import OwnPlan, apply_plan, forward_goes_through


EXPERT_COUNTS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")


def raw_hf_plan(model: nn.Module) -> Optional[dict]:
    """The model's own plan in transformers' spellings, names from the model (None: it has none); its
    ``notes`` (an ``OwnPlan``) say what hybrid added or left out."""
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
    notes = []
    embed = getattr(base, "embed_tokens", None)
    if base_plan and "embed_tokens" not in base_plan and isinstance(embed, nn.Embedding):
        # hybrid's own addition: split the input embedding by vocabulary, so a head tied to it is split alike
        if forward_goes_through(embed, nn.Embedding) and embed.max_norm is None and not embed.scale_grad_by_freq:
            base_plan = {"embed_tokens": "embedding_rowwise", **base_plan}
            if type(embed) is not nn.Embedding:
                notes.append(f"{prefix}embed_tokens split by vocabulary around its own forward "
                             f"({type(embed).__name__})")
        else:
            notes.append(f"{prefix}embed_tokens left whole ({type(embed).__name__}'s forward does not go through "
                         "nn.Embedding's)")
            head_plan = _without_tied_head(model, embed, head_plan, notes)
    plan = {**{prefix + pattern: style for pattern, style in base_plan.items()}, **head_plan}
    return OwnPlan(plan, notes)


def _without_tied_head(model: nn.Module, embed: nn.Module, head_plan: dict, notes: list) -> dict:
    """``head_plan`` less the heads that hold the (whole) input embedding's tensor."""
    out = {}
    for name, style in head_plan.items():
        head = model.get_submodule(name) if name in dict(model.named_modules()) else None
        if head is not None and getattr(head, "weight", None) is embed.weight:
            notes.append(f"{name} left whole (tied to the whole input embedding)")
            continue
        out[name] = style
    return out


def moe_refusal(model: nn.Module) -> Optional[str]:
    """Why a mixture-of-experts model is not split by TP (it runs at TP 1, its experts sharded by ZeRO), or None."""
    config = text_config(getattr(model, "config", None))
    counts = [getattr(config, field, None) for field in EXPERT_COUNTS]
    count = next((c for c in counts if isinstance(c, int) and not isinstance(c, bool) and c > 1), None)
    experts = next((name for name, _ in model.named_modules() if name.rpartition(".")[2] == "experts"), None)
    if count is None and experts is None:
        return None
    what = f"{count} experts" if count is not None else f"experts in {experts}"
    return (f"{type(model).__name__} is a mixture-of-experts model ({what}), which hybrid trains at TP 1 with its "
            "experts sharded by ZeRO until expert parallelism exists")


def hf_plan(model: nn.Module) -> Optional[dict]:
    """The model's own TP plan in hybrid's styles (``hybrid.tp.plan``; an ``OwnPlan``), or None for a model
    without one; a style hybrid does not implement, or a mixture-of-experts model, is a ``ConfigError``."""
    raw = raw_hf_plan(model)
    if raw is None:
        return None
    refusal = moe_refusal(model)
    if refusal is not None:
        raise ConfigError(f"{own_plan_name(model)} is not used: {refusal}.")
    return OwnPlan(normalize_plan(raw, own_plan_name(model)), raw.notes)


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
