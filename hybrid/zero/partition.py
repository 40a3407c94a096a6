"""Flat buffers and shard ranges (pure): where each parameter lives and which elements each DP rank owns.

Parameters are grouped into *units*; a unit is the grain of every collective (a gradient bucket at
stages 0-2, the parameters of one module at stage 3). Inside a unit the parameters lie end to end, each
starting at a multiple of ``align`` elements; the unit's length is padded up to a multiple of
``n_shards · align``, so it splits into ``n_shards`` equal shards of ``S = U / n_shards`` elements. Rank r
owns ``[r·S, (r+1)·S)`` of every unit; a parameter may straddle shard edges. Padding never holds a
parameter element, so nothing is truncated; padding is always zero in every buffer.

Two coordinate systems are used by the engine:

* full space: the units end to end (the full flat parameter/gradient buffers of stages 0-2);
* shard space: this rank's shard of every unit end to end (its master weights, Adam moments, gradient
  shard). A rank's shard is therefore one contiguous buffer of ``shard_numel`` elements, and each
  parameter contributes at most one contiguous range of its flattened elements to it.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Optional, Sequence


def align_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


@dataclass(frozen=True)
class Slot:
    param: int   # index into the layout's parameter list
    numel: int
    offset: int  # first element, relative to the unit


@dataclass(frozen=True)
class Unit:
    index: int
    slots: tuple
    numel: int          # padded length, a multiple of n_shards * align
    n_shards: int
    full_offset: int    # where the unit starts in full space
    shard_offset: int   # where this unit's shard starts in shard space

    @property
    def shard_numel(self) -> int:
        return self.numel // self.n_shards

    @property
    def param_numel(self) -> int:
        return sum(s.numel for s in self.slots)

    def shard_range(self, rank: int) -> tuple:
        """``[lo, hi)`` of the unit (unit-relative) that ``rank`` owns."""
        s = self.shard_numel
        return rank * s, (rank + 1) * s

    def padding_ranges(self) -> list:
        """``[(lo, hi)]`` (unit-relative) that hold no parameter element: alignment gaps and the tail."""
        out, pos = [], 0
        for slot in sorted(self.slots, key=lambda s: s.offset):
            if slot.offset > pos:
                out.append((pos, slot.offset))
            pos = max(pos, slot.offset + slot.numel)
        if pos < self.numel:
            out.append((pos, self.numel))
        return out


@dataclass(frozen=True)
class OwnedPiece:
    """The part of one parameter that a rank owns: param elements ``[start, end)``."""

    param: int
    start: int
    end: int
    unit: int
    unit_pos: int   # position of element ``start`` inside its unit
    shard_pos: int  # position of element ``start`` in the rank's shard space

    @property
    def numel(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class FlatLayout:
    units: tuple
    numels: tuple      # per parameter
    n_shards: int
    align: int

    @property
    def full_numel(self) -> int:
        return sum(u.numel for u in self.units)

    @property
    def shard_numel(self) -> int:
        return sum(u.shard_numel for u in self.units)

    @property
    def param_numel(self) -> int:
        return sum(self.numels)

    @cached_property
    def _where(self) -> dict:
        return {slot.param: (unit, slot) for unit in self.units for slot in unit.slots}

    def locate(self, param: int) -> tuple:
        """``(unit, slot)`` holding parameter ``param``."""
        return self._where[param]

    def owned_pieces(self, rank: int) -> list:
        """Every non-empty piece of a parameter that ``rank`` owns, in shard-space order."""
        pieces = []
        for unit in self.units:
            lo, hi = unit.shard_range(rank)
            for slot in unit.slots:
                a, b = max(lo, slot.offset), min(hi, slot.offset + slot.numel)
                if a < b:
                    pieces.append(OwnedPiece(slot.param, a - slot.offset, b - slot.offset, unit.index, a,
                                             unit.shard_offset + a - lo))
        return pieces

    def owned_range(self, param: int, rank: int) -> tuple:
        """``(start, end, shard_pos)``: the param elements ``rank`` owns (``start == end`` when none)."""
        unit, slot = self.locate(param)
        lo, hi = unit.shard_range(rank)
        a, b = max(lo, slot.offset), min(hi, slot.offset + slot.numel)
        if a >= b:
            return 0, 0, unit.shard_offset
        return a - slot.offset, b - slot.offset, unit.shard_offset + a - lo


def bucket_groups(numels: Sequence[int], order: Sequence[int], max_numel: int, align: int = 1) -> list:
    """Cut ``order`` (param indices) greedily into groups of at most ``max_numel`` aligned elements.

    A parameter larger than ``max_numel`` gets a group of its own; no group is empty.
    """
    groups, current, size = [], [], 0
    for p in order:
        need = align_up(numels[p], align)
        if current and size + need > max_numel:
            groups.append(current)
            current, size = [], 0
        current.append(p)
        size += need
    if current:
        groups.append(current)
    return groups


def build_layout(numels: Sequence[int], groups: Sequence[Sequence[int]], n_shards: int,
                 align: int = 1) -> FlatLayout:
    """Lay out ``groups`` (each a list of param indices, one unit each) for ``n_shards`` owners."""
    if n_shards < 1 or align < 1:
        raise ValueError(f"n_shards and align must be >= 1, got {n_shards}, {align}")
    seen = [p for g in groups for p in g]
    if sorted(seen) != list(range(len(numels))):
        raise ValueError("groups must hold every parameter index exactly once")
    units, full_off, shard_off = [], 0, 0
    for index, group in enumerate(groups):
        if not group:
            raise ValueError("a unit cannot be empty")
        slots, pos = [], 0
        for p in group:
            pos = align_up(pos, align)
            slots.append(Slot(p, int(numels[p]), pos))
            pos += int(numels[p])
        padded = align_up(max(pos, 1), n_shards * align)
        unit = Unit(index, tuple(slots), padded, n_shards, full_off, shard_off)
        units.append(unit)
        full_off += padded
        shard_off += unit.shard_numel
    return FlatLayout(tuple(units), tuple(int(n) for n in numels), n_shards, align)


def unit_groups(numels: Sequence[int], unit_params: Optional[Sequence[Sequence[int]]], reduce_bucket_size: int,
                persistence_threshold: int, align: int = 1) -> tuple:
    """The engine's units: ``(groups of param indices, reduce order of the units, persistent unit indices)``.

    Without ``unit_params`` (stages 0-2) the units are gradient buckets of ``reduce_bucket_size`` aligned
    elements over the parameters in reverse order, reduced in that order. With it (stage 3: the parameter
    indices of each unit root, in forward order) every root's parameters of at least
    ``persistence_threshold`` elements form one unit, reduced in reverse; the smaller ones are pooled in one
    persistent unit, last in both."""
    if unit_params is None:
        groups = bucket_groups(numels, list(reversed(range(len(numels)))), reduce_bucket_size, align)
        return groups, list(range(len(groups))), set()
    groups, small = [], []
    for params in unit_params:
        own = []
        for i in params:
            (small if numels[i] < persistence_threshold else own).append(i)
        if own:
            groups.append(own)
    order = list(reversed(range(len(groups))))
    persistent = set()
    if small:
        groups.append(small)
        persistent = {len(groups) - 1}
        order.append(len(groups) - 1)
    return groups, order, persistent
