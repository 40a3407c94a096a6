"""Which parameter group each trainable parameter belongs to (pure over names, shapes and module kinds).

A group is a weight decay and an ``lr_scale`` (times the scheduled learning rate). ``OptimizerConfig``'s
``param_groups`` entries are tried first, in order (first name-pattern match wins; a key an entry leaves
out falls back to the rule below). Then ``no_decay``: ``"auto"`` exempts 1-D parameters (biases, norm
weights) and embedding weights (parameters of a module whose class name ends in ``Embedding``) from weight
decay, ``"none"`` exempts nothing, a tuple of patterns exempts the matching names. Everything else gets
``optimizer.weight_decay`` and scale 1.

``assign(names, shapes, embeddings, cfg)`` returns ``(group index per parameter, [Group, ...])``;
``torch_param_groups(module, cfg)`` gives the same grouping as ``torch.optim`` parameter groups, for a
single-process model (the reference the engine is tested against, or a user's own loop).
"""

from __future__ import annotations

from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import Sequence

from hybrid.config.training import OptimizerConfig
from hybrid.errors import ConfigError


@dataclass(frozen=True)
class Group:
    weight_decay: float
    lr_scale: float = 1.0


def embedding_names(module) -> set:
    """Names (``named_parameters()``'s: a tied parameter goes by its first name) of the parameters registered
    on an embedding module under any of their names: a weight tied to a head declared before the embedding is
    still an embedding weight."""
    on_embeddings = {id(p) for m in module.modules() if type(m).__name__.endswith("Embedding")
                     for p in m.parameters(recurse=False)}
    return {name for name, p in module.named_parameters() if id(p) in on_embeddings}


def _exempt(name: str, shape: Sequence[int], embedding: bool, no_decay) -> bool:
    if no_decay == "none":
        return False
    if no_decay == "auto":
        return len(shape) <= 1 or embedding
    return any(fnmatchcase(name, pattern) for pattern in no_decay)


def assign(names: Sequence[str], shapes: Sequence[Sequence[int]], embeddings: set, cfg: OptimizerConfig) -> tuple:
    groups, index, of, used = [], {}, [], set()
    for name, shape in zip(names, shapes):
        wd = 0.0 if _exempt(name, shape, name in embeddings, cfg.no_decay) else cfg.weight_decay
        scale = 1.0
        for k, entry in enumerate(cfg.param_groups):
            if any(fnmatchcase(name, pattern) for pattern in entry["names"]):
                wd, scale = entry.get("weight_decay", wd), entry.get("lr_scale", scale)
                used.add(k)
                break
        group = Group(wd, scale)
        if group not in index:
            index[group] = len(groups)
            groups.append(group)
        of.append(index[group])
    _refuse_unused_entries(names, cfg.param_groups, used)
    _refuse_unmatched_no_decay(names, cfg.no_decay)
    return of, groups


def _examples(names: Sequence[str]) -> str:
    return ", ".join(repr(n) for n in list(names)[-2:])


def _refuse_unmatched_no_decay(names: Sequence[str], no_decay) -> None:
    """A ``no_decay`` pattern that matches no parameter is a typo (``'*.bais'``) or a word taken for a mode
    (``all``): every parameter would keep its weight decay without a word."""
    if no_decay in ("auto", "none"):
        return
    for pattern in no_decay:
        if not any(fnmatchcase(name, pattern) for name in names):
            raise ConfigError(f"optimizer.no_decay pattern {pattern!r} matches no trainable parameter (names look "
                              f"like {_examples(names)}; a tied parameter goes by its first name); give 'auto', "
                              "'none' or name patterns such as ['*.bias', '*norm*.weight'] (fnmatch: '*' also "
                              "matches dots)")


def _refuse_unused_entries(names: Sequence[str], entries, used: set) -> None:
    """An entry that takes no parameter (its patterns match none, or only ones an earlier entry took: the
    first match wins) would silently change nothing."""
    for k, entry in enumerate(entries):
        if k in used:
            continue
        patterns = list(entry["names"])
        if any(fnmatchcase(name, pattern) for name in names for pattern in patterns):
            raise ConfigError(f"optimizer.param_groups[{k}].names {patterns} match only parameters an earlier "
                              "entry already takes (the first match wins); put it before that entry, or "
                              "remove it")
        raise ConfigError(f"optimizer.param_groups[{k}].names {patterns} match no trainable parameter (names "
                          f"look like {_examples(names)}; a tied parameter goes by its first name); fix the patterns "
                          "(fnmatch: '*' also matches dots)")


def torch_param_groups(module, cfg: OptimizerConfig) -> list:
    """``[{"params": [...], "weight_decay": wd, "lr": lr}]`` for ``module``'s trainable parameters (tied ones
    once, under their first name), grouped as the engine groups them."""
    named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
    of, groups = assign([n for n, _ in named], [tuple(p.shape) for _, p in named], embedding_names(module), cfg)
    return [{"params": [p for (_, p), g in zip(named, of) if g == k], "weight_decay": group.weight_decay,
             "lr": cfg.lr * group.lr_scale} for k, group in enumerate(groups)]
