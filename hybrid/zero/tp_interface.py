"""What the ZeRO engine reads of tensor parallelism: the parameters' marks and modules split over a TP group.

ZeRO imports no TP layer. It sees tensor parallelism in two ways only:

* each parameter's mark (``hybrid.weights.attrs``): whether it is sliced across the TP group and along which
  dimension, which decides how its gradient counts in the global norm and how its slices make the full
  tensor in ``full_state_dict`` (``gather_tp_tensor``, over the engine's own TP ``Comm``);
* ``SplitOverTP``: a module whose own parameters are split over a TP group says which one
  (``tp_split()``: its size and its ``Comm``), so the engine can refuse a ``tp_group`` that is not that
  group. ``hybrid.tp``'s layers (``TensorParallelModule``) satisfy it; a module that only holds such layers
  (a model that keeps a ``tp_comm`` to pass down) does not claim it.
"""

from __future__ import annotations

from typing import Optional, Protocol, runtime_checkable

from torch import nn

from hybrid.comm.collectives import Comm


@runtime_checkable
class SplitOverTP(Protocol):
    """A module whose own parameters are split over a TP group."""

    def tp_split(self) -> tuple[int, Optional[Comm]]:
        """``(TP degree, the Comm of that group)`` its parameters are split over: ``(1, None)`` when not split."""


def split_over_tp(module: nn.Module) -> list:
    """``[(qualified name, submodule)]`` of the modules of ``module`` (itself included) split over a TP group,
    in ``named_modules`` order."""
    return [(name, sub) for name, sub in module.named_modules() if isinstance(sub, SplitOverTP)]
