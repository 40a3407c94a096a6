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

At TP > 1 ``parallelize`` leaves a causal LM's logits split by vocabulary, its loss vocabulary-parallel, where
its forward allows it (``hybrid.tp.hf_logits``); ``splits_logits(model, tp)`` says whether it will.

What the config says about splitting (heads, MLP, vocabulary; ``largest_tp``) is ``hybrid.tp.hf_config``.
"""

from __future__ import annotations

import logging
from typing import Optional

from torch import nn

from hybrid.comm.collectives import Comm
from hybrid.errors import ConfigError
from hybrid.config.tp_plan import normalize_plan, pattern_matches
from hybrid.tp.forward_record import shared
from hybrid.tp.hf_config import text_config
from hybrid.tp.hf_logits import logits_refusal, output_head, split_logits, uses_split_logits
from hybrid.tp.plan import OwnPlan, apply_plan, forward_goes_through
from hybrid.tp.sharding import tp_rank_size
from hybrid.tp.styles import ColwiseGatheredLinear, SplitModule

log = logging.getLogger(__name__)


EXPERT_COUNTS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")


def raw_hf_plan(model: nn.Module) -> Optional[dict]:
    """The model's own plan in transformers' spellings, names from the model (None: it has none); its
    ``notes`` (an ``OwnPlan``) say what hybrid added or left out. Each base model inside it (the causal LM's
    ``model``; a multimodal model's ``model.language_model``) brings its config's plan under its own name."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "base_model_tp_plan"):
        return None
    base_plan = {}
    for name, module in model.named_modules():
        plan = getattr(getattr(module, "config", None), "base_model_tp_plan", None)
        if plan and _is_base_model(module):
            prefix = name + "." if name else ""
            base_plan.update({prefix + pattern: style for pattern, style in plan.items()})
    head_plan = dict(getattr(type(model), "_tp_plan", None) or {}) if not _is_base_model(model) else {}
    if not base_plan and not head_plan:
        return None
    notes = []
    plan = {**base_plan, **head_plan}
    name, embed = _input_embedding(model)
    if base_plan and embed is not None and not any(pattern_matches(p, name) for p in plan):
        # hybrid's own addition: split the input embedding by vocabulary, so a head tied to it is split alike
        if forward_goes_through(embed, nn.Embedding) and embed.max_norm is None and not embed.scale_grad_by_freq:
            plan = {name: "embedding_rowwise", **plan}
            if type(embed) is not nn.Embedding:
                notes.append(f"{name} split by vocabulary around its own forward ({type(embed).__name__})")
        else:
            notes.append(f"{name} left whole ({type(embed).__name__}'s forward does not go through "
                         "nn.Embedding's)")
            plan = _without_tied_head(model, embed, plan, notes)
    return OwnPlan(plan, notes)


def _is_base_model(module: nn.Module) -> bool:
    """A transformers base model (its plan's names are relative to it), not a model with a head around one."""
    prefix = getattr(module, "base_model_prefix", None)
    if not isinstance(prefix, str) or not hasattr(module, "config"):
        return False
    inner = getattr(module, prefix, None) if prefix else None
    return not isinstance(inner, nn.Module) or inner is module


def _input_embedding(model: nn.Module) -> tuple[str, Optional[nn.Embedding]]:
    """The model's input embedding (``get_input_embeddings()``, a multimodal model's text one too) and its
    name, or ``("", None)`` when it has no ``nn.Embedding`` there."""
    get = getattr(model, "get_input_embeddings", None)
    try:
        embed = get() if callable(get) else None
    except (NotImplementedError, AttributeError):
        return "", None
    if not isinstance(embed, nn.Embedding):
        return "", None
    name = next((n for n, m in model.named_modules() if m is embed), "")
    return (name, embed) if name else ("", None)


def _without_tied_head(model: nn.Module, embed: nn.Module, plan: dict, notes: list) -> dict:
    """``plan`` less the modules that hold the (whole) input embedding's tensor (a tied head)."""
    modules = dict(model.named_modules())
    out = {}
    for pattern, style in plan.items():
        tied = [n for n, m in modules.items() if pattern_matches(pattern, n) and m is not embed
                and getattr(m, "weight", None) is embed.weight]
        if tied:
            notes.append(f"{tied[0]} left whole (tied to the whole input embedding)")
            continue
        out[pattern] = style
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
    plan (``hf_plan``); returns it. At TP > 1 a causal LM's head split with gathered output keeps its logits
    split by vocabulary, its loss vocabulary-parallel (``hybrid.tp.hf_logits``), where its forward allows it;
    else the logits are gathered, and the plan's notes (and the log) say why."""
    if plan is None:
        plan = hf_plan(model)
        where = own_plan_name(model)
        if plan is None:
            raise ConfigError(f"{type(model).__name__} has no TP plan of its own (no config.base_model_tp_plan); "
                              "give one: parallel.tp_plan in the cluster file, or hybrid.tp.apply_plan(model, plan, "
                              "tp_comm).")
    tp = tp_rank_size(tp_comm)[1]
    gathered_head = tp > 1 and _plans_gathered_head(model, plan, where)
    with shared(model):  # one run of the whole model's forward answers both, before the split
        refusal = logits_refusal(model) if gathered_head else None
        apply_plan(model, plan, tp_comm, where)  # its regions (hybrid.tp.regions) read that run
    if gathered_head and refusal is None:
        split_logits(model, tp_comm)
        model.hybrid_tp_notes.append("logits left split by vocabulary (a vocabulary-parallel loss)")
    elif gathered_head:
        log.info("%s: the logits are gathered on every TP rank, as %s", type(model).__name__, refusal)
        model.hybrid_tp_notes.append(f"logits gathered on every TP rank ({refusal})")
    return model


def _plans_gathered_head(model: nn.Module, plan: dict, where: str = "the TP plan") -> bool:
    """Whether ``plan`` splits the model's output embedding colwise with gathered output (``colwise_rep``)."""
    head = output_head(model)
    name = next((n for n, m in model.named_modules() if m is head), None) if head is not None else None
    return name is not None and any(style == "colwise_rep" and pattern_matches(pattern, name)
                                    for pattern, style in normalize_plan(plan, where).items())


def splits_logits(model: nn.Module, tp: int) -> bool:
    """Whether ``hybrid.tp.parallelize`` (``Context.parallelize``) leaves ``model``'s logits split by vocabulary
    over ``tp`` TP ranks, each holding ``V/tp`` of them (the planner's memory question). ``model``: whole (split
    by its own plan), or split at TP 1 by a plan (as the launcher holds it), or split by ``parallelize``."""
    head = output_head(model)
    if tp <= 1 or head is None:
        return False
    if uses_split_logits(model):
        return True
    if isinstance(head, SplitModule):  # at TP > 1 split by apply_plan alone: its logits stay gathered
        plan_says = isinstance(head, ColwiseGatheredLinear) and head.tp == 1
    elif any(isinstance(m, SplitModule) for m in model.modules()):
        plan_says = False  # split by a plan that leaves the head whole
    else:
        try:
            own = hf_plan(model)
        except ConfigError:  # a mixture-of-experts model: not split
            return False
        plan_says = own is not None and _plans_gathered_head(model, own)
    return plan_says and logits_refusal(model) is None
