"""The layout arithmetic the engine and the memory model share (pure: no torch, plain numbers).

Everything here is a size or a position: where each parameter lives in the flat buffers and which elements
each DP rank owns (``FlatLayout``, ``unit_groups``, ``stage_layout``), and how many elements the engine's
working buffers hold (the optimizer's batches, the gradient buckets a CPU rank keeps, gloo's exchange
buffers, the shared-memory transport's pages). The engine (``hybrid.zero``, ``hybrid.comm``) allocates by
these rules and ``hybrid.plan.memory`` predicts from them, so the prediction cannot drift from the engine.

Flat layout. Parameters are grouped into *units*; a unit is the grain of every collective (a gradient bucket
at stages 0-2, the parameters of one module at stage 3). Inside a unit the parameters lie end to end, each
starting at a multiple of ``align`` elements (``ALIGN_BYTES``: ``align_elements``); the unit's length is
padded up to a multiple of ``n_shards · align``, so it splits into ``n_shards`` equal shards of
``S = U / n_shards`` elements. Rank r owns ``[r·S, (r+1)·S)`` of every unit; a parameter may straddle shard
edges. Padding never holds a parameter element, so nothing is truncated; padding is always zero in every
buffer.

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

from hybrid.config.stage_policy import StagePolicy, policy_for

ALIGN_BYTES = 16  # each parameter starts at a multiple of this many bytes inside its unit


def align_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def align_elements(itemsize: int) -> int:
    """The ``align`` of a layout whose elements are ``itemsize`` bytes: ``ALIGN_BYTES`` in elements."""
    return max(1, ALIGN_BYTES // int(itemsize))


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


@dataclass(frozen=True)
class ModelUnits:
    """What the engine's unit rules read of a model, as plain numbers: the trainable parameters' element counts
    in ``named_parameters`` order (each parameter once), and the parameter indices of each stage-3 unit
    (``hybrid.zero.units.model_units`` reads them off a model)."""

    numels: tuple
    stage3_units: tuple

    @classmethod
    def from_lists(cls, units) -> "ModelUnits":
        """``[[numel, ...], ...]``: the parameters in order, each inner list one stage-3 unit."""
        numels, groups, start = [], [], 0
        for own in units:
            numels += [int(n) for n in own]
            groups.append(tuple(range(start, start + len(own))))
            start += len(own)
        return cls(tuple(numels), tuple(groups))


def stage_layout(numels: Sequence[int], unit_params: Optional[Sequence[Sequence[int]]], policy: StagePolicy,
                 dp: int, align: int, reduce_bucket_size: int, persistence_threshold: int) -> tuple:
    """``(FlatLayout, reduce order of the units, persistent unit indices)`` of a stage: ``unit_groups`` (with
    ``unit_params``, the parameter indices of each unit root, where the stage's units follow the module
    tree; ignored otherwise), cut into the stage's ``n_shards`` on ``dp`` ranks."""
    groups, order, persistent = unit_groups(numels, unit_params if policy.module_units else None,
                                            reduce_bucket_size, persistence_threshold, align)
    return build_layout(numels, groups, policy.n_shards(dp), align), order, persistent


# ------------------------------------------------------------------------------------- the optimizer
# Elements of non-fp32 gradients converted to fp32 at a time, per device type the conversion runs on. CPU:
# one reused 4 MB scratch, a few fused calls per step instead of one and no shard-sized fp32 copy: fused
# AdamW over 4.3M elements took as long in 1M chunks as in one 4M call (9.2 ms, one thread), and the chunk
# stays in cache between its conversion and its step. A device type not listed here (CUDA) has no such bound:
# a batch is converted in one call and stepped in one fused call per parameter group, as DeepSpeed steps a
# sub-group and FSDP2 its shards, bounded only by ``sub_group_size`` and the memory the scratch may use.
CONVERT_NUMEL = 1 << 20
CONVERT_LIMITS = {"cpu": CONVERT_NUMEL}


def batch_numel(sub_group_size: int, grad_is_fp32: bool, device: str = "cpu",
                scratch_bytes: Optional[int] = None) -> int:
    """The most elements one optimizer batch steps at once (``hybrid.zero.optimizer``) on a ``device`` type
    (``"cpu"``, ``"cuda"``, ...): ``sub_group_size``; with non-fp32 gradients, which are converted into an fp32
    scratch of one batch, also the device's ``CONVERT_LIMITS`` and ``scratch_bytes // 4`` (the free memory
    the scratch may use; None: no bound). The memory model sizes the scratch by the same rule."""
    n = int(sub_group_size)
    if grad_is_fp32:
        return n
    limit = CONVERT_LIMITS.get(str(device))
    if limit is not None:
        n = min(n, limit)
    if scratch_bytes is not None:
        n = min(n, max(1, int(scratch_bytes) // 4))
    return n


@dataclass(frozen=True)
class StepRule:
    """How the optimizer step and the gradient norm treat non-fp32 gradients on one device (``step_rule``)."""

    batch_numel: int                    # elements one optimizer batch converts and steps at once
    norm_convert_numel: Optional[int]   # elements the norm converts at a time; None: one _foreach_norm per dtype
    keep_scratch: bool                  # the fp32 scratch is kept between steps (else back to the allocator)
    per_piece: bool                     # each piece converted and scaled while in cache, else one call a batch


def step_rule(device: str, grad_is_fp32: bool, sub_group_size: int, scratch_bytes: Optional[int] = None) -> StepRule:
    """The rule of a ``device`` type. Where conversion is bounded (``CONVERT_LIMITS``: the CPU) the scratch is a
    few MB, kept, and each piece is converted and scaled in turn while it is in cache; elsewhere (a GPU) a batch
    is a whole sub-group (``batch_numel``), converted, scaled and written back in one call each, its scratch
    returned to the allocator after the step (whose cache hands it to the next backward's activations: the
    step never overlaps them), and the norm is one fp32 ``_foreach_norm`` per gradient dtype, without a copy."""
    bounded = str(device) in CONVERT_LIMITS
    return StepRule(batch_numel(sub_group_size, grad_is_fp32, device, scratch_bytes), CONVERT_LIMITS.get(str(device)),
                    keep_scratch=bounded, per_piece=bounded)


def host_arena_bytes(shard_numel, grad_itemsize: int, state_keys: int, nvme: bool = False):
    """Bytes of a rank's host arena with the optimizer offloaded (``hybrid.zero.host_arena``): the fp32 master
    shard, the host copy of the gradient shard (``grad_itemsize`` bytes an element) and ``state_keys`` fp32
    state buffers (2 for Adam(W): its moments), carved in that order. Every region ends 16-byte aligned (a
    shard is a multiple of 16 bytes in the model dtype), so nothing pads between them; the memory model's host
    figure is this with ``shard_numel = Ψ/(t·N)``. (The CPU step's fp32 scratch, a few MB, stays apart.) With
    ``nvme`` the master and the state are the swap file's records (``hybrid.zero.nvme``), so the arena holds the
    gradient copy alone (the store's record buffers, ``swap_layout.swap_buffer_bytes``, stay apart)."""
    fp32_arrays = 0 if nvme else 1 + int(state_keys)
    return (4 * fp32_arrays + int(grad_itemsize)) * shard_numel


# --------------------------------------------------------------------------------- gradient buckets
KEEP_BUCKET_NUMEL = 1 << 22  # CPU: elements of gradient buckets in use and kept for the next backward


def kept_bucket_numel(unit_numels: Sequence[int], stage: int) -> int:
    """Elements of buckets a CPU rank keeps between backward passes at ``stage`` (``hybrid.zero.buckets``):
    where gradients go through buckets (``StagePolicy.bucket_buffers``) units reduce one after another, so
    their buckets are kept smallest-first until ``KEEP_BUCKET_NUMEL`` -- an upper bound on what the bucket
    pool keeps."""
    if not policy_for(stage).bucket_buffers:
        return 0
    kept = 0
    for n in sorted(unit_numels):
        if kept + n > KEEP_BUCKET_NUMEL:
            break
        kept += n
    return kept


# ----------------------------------------------------------------- gloo's pairwise exchange (hybrid.comm)
EXCHANGE_NUMEL = 1 << 21  # elements per peer per slice of the pairwise reduce-scatter (8 MB in fp32)
EXCHANGE_SLICES = 2       # slices in flight (so ``EXCHANGE_SLICES · (N-1) · EXCHANGE_NUMEL`` elements at most)
EXCHANGE_MIN_NUMEL = 1 << 24  # gloo all-reduces from this many elements (64 MB fp32) go as exchange + broadcasts
# CPU tensors from this size go through shared memory (where the group can); below it gloo's latency is small
# in absolute terms and the staging pages would cost more memory than the data moved
SHM_MIN_BYTES = 1 << 20


def exchange_shape(numel: int, size: int, slice_numel: int = EXCHANGE_NUMEL,
                   in_flight: int = EXCHANGE_SLICES) -> tuple:
    """``(width, slices, slots)`` of the pairwise exchange of ``numel`` elements over ``size`` ranks, in slices
    of at most ``slice_numel`` elements per peer with ``in_flight`` of them in flight: the elements per peer of
    one receive slice, the slices the longest part (``tensor_split``'s first) is sent in, and the slices in
    flight -- one receive buffer of ``(size - 1) · width`` elements each."""
    longest = -(-numel // size)
    slices = -(-longest // slice_numel)
    return min(longest, slice_numel), slices, min(in_flight, slices)


def exchange_cap_numel(size: int, slice_numel: int = EXCHANGE_NUMEL, in_flight: int = EXCHANGE_SLICES) -> int:
    """Elements of receive buffers the pairwise reduce-scatter of a group of ``size`` holds at most (in use
    and kept for reuse, handles waited in launch order): ``in_flight`` slices of ``slice_numel`` from each of
    the N-1 peers."""
    return in_flight * (size - 1) * slice_numel


def exchange_numel(unit_numels: Sequence[int], size: int, stage: int) -> int:
    """Elements of receive buffers kept after a step's gradient collectives over units of ``unit_numels``
    elements on gloo (all-reduced gradients, ``StagePolicy.grads_all_reduced``, from ``EXCHANGE_MIN_NUMEL``;
    reduce-scattered ones always), each unit counted with its own buffers, within the cap (the memory
    model's figure)."""
    all_reduced = policy_for(stage).grads_all_reduced
    need = 0
    for n in unit_numels:
        if all_reduced and n < EXCHANGE_MIN_NUMEL:
            continue
        width, _, slots = exchange_shape(n, size)
        need += slots * (size - 1) * width
    return min(need, exchange_cap_numel(size))


# --------------------------------------------------------- the shared-memory transport (hybrid.comm.shm)
SLICE_BYTES = 1 << 20  # bytes of one buffer (its N-1 peer slots together)
PAGE_BYTES = 4096


def slot_bytes(size: int, slice_bytes: int = SLICE_BYTES) -> int:
    """Bytes of one peer slot of a buffer of ``slice_bytes`` in a group of ``size`` ranks (64-byte aligned)."""
    return max(64, slice_bytes // (size - 1) // 64 * 64)


def region_bytes(size: int, slice_bytes: int = SLICE_BYTES) -> int:
    """Bytes of one rank's region in a group of ``size`` ranks: two buffers of N-1 slots."""
    return 2 * (size - 1) * slot_bytes(size, slice_bytes)


def resident_bytes(size: int, largest_bytes: int) -> int:
    """Resident bytes a rank of a group of ``size`` holds for the group when its largest collective moves
    ``largest_bytes`` (the memory model's figure): the pages it touches of its own region and of the
    slots it reads in its peers' regions (its reduce-scatter slot and the all-gather slot, both buffers).
    Only touched pages count: a slot is filled to one rank's part of the collective, at most a slot."""
    if largest_bytes <= 0:
        return 0
    page = PAGE_BYTES
    part = -(-largest_bytes // size)
    slot = min(-(-slot_bytes(size) // page) * page, -(-part // page) * page)
    slots_read = 2 if size == 2 else 4
    return 2 * (size - 1) * slot + (size - 1) * slots_read * slot
