"""Learning-rate schedules (pure): DeepSpeed's ``WarmupLR``, ``WarmupDecayLR`` and ``WarmupCosineLR``.

``SCHEDULES`` maps each type to its parameters and their defaults (DeepSpeed's names). ``lr_at(kind,
params, base_lr, i)`` is the learning rate of the ``i``-th optimizer step counted from 0 (so the first
step uses ``i = 0``, as with a torch scheduler that is stepped after every ``optimizer.step()``), for a
parameter group whose unscheduled learning rate is ``base_lr`` (``optimizer.lr`` times the group's
``lr_scale``). The formulas are DeepSpeed's (``deepspeed.runtime.lr_schedules``):

* ``WarmupLR``: from ``warmup_min_lr`` to ``warmup_max_lr`` over ``warmup_num_steps`` (``warmup_type``
  ``log``: ``log(i + 1) / log(n)``; ``linear``: ``i / n``), then constant. The two absolute rates are those
  of ``optimizer.lr``; a group with another ``lr_scale`` gets them scaled alike. ``warmup_max_lr``
  defaults to ``optimizer.lr`` (DeepSpeed: 0.001).
* ``WarmupDecayLR``: ``WarmupLR``, then linear decay to 0 at ``total_num_steps``:
  ``(total - i) / (total - warmup)``.
* ``WarmupCosineLR``: ratios of the base rate: from ``warmup_min_ratio`` to 1 over the warmup, then
  ``cos_min_ratio + (1 - cos_min_ratio) (1 + cos(pi p)) / 2`` with ``p = min(1, (i - warmup + 1) /
  (total - warmup))``: ``cos_min_ratio`` from step ``total_num_steps - 1`` on (it does not rise again).

The schedule's state is the number of optimizer steps taken, nothing else; a checkpoint records it.
"""

from __future__ import annotations

import math
from typing import Mapping

SCHEDULES = {
    "WarmupLR": {"warmup_min_lr": 0.0, "warmup_max_lr": None, "warmup_num_steps": 1000, "warmup_type": "log"},
    "WarmupDecayLR": {"warmup_min_lr": 0.0, "warmup_max_lr": None, "warmup_num_steps": 1000,
                      "warmup_type": "log", "total_num_steps": None},
    "WarmupCosineLR": {"total_num_steps": None, "warmup_min_ratio": 0.0, "warmup_num_steps": 1000,
                       "cos_min_ratio": 0.0001, "warmup_type": "log"},
}
WARMUP_TYPES = ("log", "linear")
REQUIRED = ("total_num_steps",)  # a None default above: the user must give it (WarmupDecayLR, WarmupCosineLR)


def _warmup_gamma(params: Mapping, i: int) -> float:
    """0 -> 1 over the warmup, 1 after it."""
    n = max(2, int(params["warmup_num_steps"])) if params["warmup_type"] == "log" else \
        max(1, int(params["warmup_num_steps"]))
    if i >= int(params["warmup_num_steps"]):
        return 1.0
    if params["warmup_type"] == "log":
        return math.log(i + 1) / math.log(n)
    return i / n


def lr_at(kind: str, params: Mapping, base_lr: float, i: int, optimizer_lr: float) -> float:
    """The learning rate of step ``i`` (0-based) for a group whose rate without a schedule is ``base_lr``;
    ``optimizer_lr`` is the configured ``optimizer.lr`` (WarmupLR's absolute rates refer to it)."""
    if kind == "WarmupCosineLR":
        return base_lr * _cosine_ratio(params, i)
    scale = base_lr / optimizer_lr if optimizer_lr else 1.0
    lo = float(params["warmup_min_lr"])
    hi = optimizer_lr if params["warmup_max_lr"] is None else float(params["warmup_max_lr"])
    lr = lo + (hi - lo) * _warmup_gamma(params, i)
    warmup = int(params["warmup_num_steps"])
    if kind == "WarmupDecayLR" and i >= warmup:
        total = int(params["total_num_steps"])
        lr = lo + (hi - lo) * max(0.0, (total - i) / max(1.0, total - warmup))
    return lr * scale


def _cosine_ratio(params: Mapping, i: int) -> float:
    warmup, total = int(params["warmup_num_steps"]), int(params["total_num_steps"])
    if i < warmup:
        low = float(params["warmup_min_ratio"])
        return low + (1.0 - low) * _warmup_gamma(params, i)
    cos_min = float(params["cos_min_ratio"])
    progress = min(1.0, (i - warmup + 1) / max(1, total - warmup))  # held at the end: no rise past total
    ratio = (1 + math.cos(math.pi * progress)) / 2
    return max(0.0, cos_min + (1.0 - cos_min) * ratio)
