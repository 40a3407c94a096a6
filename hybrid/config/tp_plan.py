"""A TP plan as a user writes it: module-name patterns -> styles, checked without torch (the launcher reads
``parallel.tp_plan`` with it; ``hybrid.tp.plan`` applies a plan to a model).

A pattern is a module name whose dot-separated parts may hold shell wildcards: ``*`` is any one part
(``model.layers.*.self_attn.q_proj``, Hugging Face's spelling), ``*_proj`` any part ending in ``_proj``.
``STYLES`` are hybrid's; Hugging Face's spellings of the same styles (``HF_SPELLINGS``) are accepted and read
as hybrid's (``colwise_gather_output`` is ``colwise_rep``, ``embedding_rowwise`` is ``vocab``, ...).
"""

from __future__ import annotations

from fnmatch import fnmatchcase
from typing import Any

from hybrid.config import validate as v
from hybrid.errors import ConfigError

STYLES = ("colwise", "colwise_rep", "rowwise", "rowwise_rep", "local_rowwise", "vocab", "embedding_col",
          "all_reduce", "replicate_grad", "mla_kv_a_proj", "replicate")
# Hugging Face's names (transformers 4.x and 5.x) for the same styles. unit_colwise / unit_rowwise split by
# whole heads, which colwise / rowwise do here whenever the degree divides the heads (the only case hybrid
# splits); local_params runs a module on its own parameters' local slices, which every hybrid module does.
HF_SPELLINGS = {"colwise_gather_output": "colwise_rep", "rowwise_split_input": "rowwise_rep",
                "embedding_rowwise": "vocab", "embedding_colwise": "embedding_col", "local_colwise": "colwise",
                "gather": "all_reduce", "replicated_with_grad_allreduce": "replicate_grad",
                "unit_colwise": "colwise", "unit_rowwise": "rowwise", "local_params": "replicate"}
EXAMPLE = "{'layers.*.mlp.up_proj': colwise, 'layers.*.mlp.down_proj': rowwise}"


OWN = "own"  # parallel.tp_plan: own -- the model's own Hugging Face plan, applied by the entrypoint


def normalize_plan(plan: Any, where: str = "the TP plan") -> dict[str, str] | str:
    """``plan`` (pattern -> style, Hugging Face spellings allowed) checked, in hybrid's own style names; or
    ``OWN``, the model's own Hugging Face plan."""
    if isinstance(plan, str):
        if plan == OWN:
            return OWN
        raise v.invalid(where, f"'{OWN}' (the model's own Hugging Face plan) or a mapping like {EXAMPLE}", plan)
    plan = v.mapping(where, plan, example=EXAMPLE)
    if not plan:
        raise ConfigError(f"{where} is empty; give module-name patterns and their styles, like {EXAMPLE}.")
    out = {}
    for pattern, style in plan.items():
        if not isinstance(pattern, str) or not pattern.strip() or pattern != pattern.strip():
            raise ConfigError(f"{where} has the pattern {v.quote(pattern)}; a pattern is a module name such as "
                              "'layers.*.mlp.up_proj'.")
        name = HF_SPELLINGS.get(style, style) if isinstance(style, str) else style
        if name not in STYLES:
            spellings = ", ".join(f"{hf} = {ours}" for hf, ours in HF_SPELLINGS.items())
            raise ConfigError(f"{where}[{pattern!r}] is {v.quote(style)}, which is not a TP style hybrid "
                              f"implements; use one of {', '.join(STYLES)} (Hugging Face's {spellings}).")
        out[pattern] = name
    return out


def pattern_matches(pattern: str, name: str) -> bool:
    """Whether module ``name`` matches ``pattern``: as many dot-separated parts, each matching as a shell
    wildcard (``*`` is any one part)."""
    parts, names = pattern.split("."), name.split(".")
    return len(parts) == len(names) and all(fnmatchcase(n, p) for n, p in zip(names, parts))
