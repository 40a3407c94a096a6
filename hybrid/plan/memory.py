"""The seed's memory model: per-GPU model-state bytes for ZeRO stages 0-3, plus an activation estimate.

Model states (zero-stages.txt, sections 1-4). With Ψ parameters, tensor-parallel degree t and data-parallel
degree N, every GPU holds Ψ/t parameters before ZeRO; ZeRO then divides, per stage:

    stage 0: P·Ψ/t       + G·Ψ/t       + O·Ψ/t
    stage 1: P·Ψ/t       + G·Ψ/t       + O·Ψ/(t·N)     optimizer states sharded
    stage 2: P·Ψ/t       + G·Ψ/(t·N)   + O·Ψ/(t·N)     + gradients sharded
    stage 3: P·Ψ/(t·N)   + G·Ψ/(t·N)   + O·Ψ/(t·N)     + parameters sharded

where (P, G, O) bytes per parameter are (2, 2, 12) for bf16 mixed precision (bf16 params and grads; fp32
master weights, momentum and variance) and (4, 4, 8) for plain fp32 (the fp32 params are the master copy).

With a shard group of s ranks (``zero.shard_group``, MiCS / HSDP: sharded within the group, replicated across the
N/s groups) every N above is s: 16Ψ/(t·s) per GPU at stage 3 in bf16. hpZ's secondary shard
(``zero.secondary_shard`` h) adds P·Ψ/(t·h): each rank keeps 1/h of the gathered parameters for backward.

The arithmetic is exact (fractions), so the seed's tables come out to the digit: 7B on 8 GPUs gives
112 / 38.5 / 26.25 / 14 GB. Each byte count is returned as an ``int`` when it is a whole number and as the
correctly rounded ``float`` otherwise. GB here means 10^9 bytes, as in the seed.

Activations (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models"),
bytes per transformer layer for sequence length s, micro-batch b, hidden size h, a attention heads:

    s·b·h·(10 + 24/t + 5·a·s/(h·t))     (t = 1 gives the no-TP form s·b·h·(34 + 5·a·s/h))
    2·s·b·h                             with full activation checkpointing (only each layer's input kept)

That formula is what ``hybrid estimate`` takes for a shape declared without a model; the plan's figures are the
model's measured profile's (``profile_activation_bytes``, from ``hybrid.plan.profile``), the built-in GPT's
included (its own analytic formula, ``tests/oracles.py``, is the tests' oracle for that path).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from fractions import Fraction
from typing import Optional

from hybrid.config import validate as v
from hybrid.config.stage_policy import policy_for
from hybrid.config.training import ZeroConfig
from hybrid.config.validate import DEFAULT_PRECISION, PRECISIONS, STAGES
from hybrid.errors import ConfigError
from hybrid.plan.layout import (SHM_MIN_BYTES, ModelUnits, align_elements, batch_numel, exchange_numel,
                                host_arena_bytes, kept_bucket_numel, resident_bytes, stage_layout, step_rule)
from hybrid.plan.links import ShardTopology

# Bytes per parameter: (parameters, gradients, optimizer states).
BYTES_PER_PARAM = {
    "bf16": (2, 2, 12),  # bf16 params + bf16 grads; fp32 master, exp_avg, exp_avg_sq
    "fp32": (4, 4, 8),  # fp32 params (the master) + fp32 grads; fp32 exp_avg, exp_avg_sq
}

GB = 10**9
MAX_COUNT = 10**18  # a parameter count beyond this is a typo, and its arithmetic would only get slow

_SUFFIX = {"": 1, "K": 10**3, "M": 10**6, "B": 10**9, "G": 10**9, "T": 10**12}


@dataclass(frozen=True)
class ModelStateBytes:
    """Per-GPU bytes of one stage's model states; ``total`` is the exact sum of the three."""

    params: int | float
    grads: int | float
    optimizer: int | float
    total: int | float


def _number(value: Fraction) -> int | float:
    return int(value) if value.denominator == 1 else float(value)


def _positive_int(value, field: str) -> int:
    return v.positive_int(field, value)


def _check_precision(precision: str) -> tuple[int, int, int]:
    return BYTES_PER_PARAM[v.one_of("precision", precision, PRECISIONS)]


def bytes_per_param(precision: str, reduce_dtype: Optional[str] = None) -> tuple[int, int, int]:
    """(parameter, gradient, optimizer) bytes per parameter: ``BYTES_PER_PARAM[precision]``, with the
    gradients in ``reduce_dtype`` (``zero.reduce_dtype``: fp32 gradients of a bf16 model) when given."""
    p_bytes, g_bytes, o_bytes = _check_precision(precision)
    if reduce_dtype is not None:
        g_bytes = DTYPE_BYTES[v.one_of("zero.reduce_dtype", reduce_dtype, PRECISIONS)]
    return p_bytes, g_bytes, o_bytes


def model_state_bytes(
    params: int, dp: int, stage: int, tp: int = 1, precision: str = DEFAULT_PRECISION,
    reduce_dtype: Optional[str] = None, *, shard: int | None = None, secondary: int = 1
) -> ModelStateBytes:
    """Per-GPU bytes of parameters, gradients (in ``reduce_dtype``, default the model's) and optimizer states
    at ZeRO ``stage``, sharded over ``shard`` of the ``dp`` ranks (default all) and, at stage 3, with hpZ's
    secondary shard over ``secondary`` ranks (1: none)."""
    params = _positive_int(params, "params")
    dp = _positive_int(dp, "dp")
    tp = _positive_int(tp, "tp")
    s = dp if shard is None else _positive_int(shard, "shard")
    policy = policy_for(v.stage("stage", stage))
    p_bytes, g_bytes, o_bytes = bytes_per_param(precision, reduce_dtype)

    local = Fraction(params, tp)  # what one GPU holds before ZeRO
    part = local / s
    p = p_bytes * (part if policy.shard_params else local)
    if policy.shard_params and _positive_int(secondary, "secondary") > 1:
        p += p_bytes * local / secondary
    g = g_bytes * (part if policy.shard_grads else local)
    o = o_bytes * (part if policy.shard_optimizer else local)
    return ModelStateBytes(_number(p), _number(g), _number(o), _number(p + g + o))


def all_stages(params: int, dp: int, tp: int = 1, precision: str = DEFAULT_PRECISION,
               reduce_dtype: Optional[str] = None, *, shard: int | None = None,
               secondary: int = 1) -> dict[int, ModelStateBytes]:
    """``model_state_bytes`` for every stage, keyed 0..3."""
    return {s: model_state_bytes(params, dp, s, tp, precision, reduce_dtype, shard=shard, secondary=secondary)
            for s in STAGES}


def activation_bytes(
    seq: int,
    micro_batch: int,
    hidden: int,
    heads: int,
    layers: int,
    tp: int = 1,
    checkpointing: bool = False,
) -> float:
    """Activation bytes per GPU for one micro-batch through ``layers`` transformer layers (Korthikanti 2022)."""
    s = _positive_int(seq, "seq")
    b = _positive_int(micro_batch, "micro_batch")
    h = _positive_int(hidden, "hidden")
    a = _positive_int(heads, "heads")
    n_layers = _positive_int(layers, "layers")
    t = _positive_int(tp, "tp")
    if a % t:
        raise ConfigError(f"heads ({a}) must be divisible by the TP degree ({t}); change heads or tp")

    sbh = s * b * h
    if checkpointing:
        per_layer = Fraction(2 * sbh)
    else:
        per_layer = sbh * (10 + Fraction(24, t) + Fraction(5 * a * s, h * t))
    return float(per_layer * n_layers)


# A number's integer part in thousands groups, all with one separator: 1,500,000 or 1_500_000.
_GROUPED = re.compile(r"([+-]?)([0-9]{1,3}(?:,[0-9]{3})+|[0-9]{1,3}(?:_[0-9]{3})+)(?![0-9,_])")


def _without_separators(raw: str, text, field: str) -> str:
    """``raw`` with the thousands separators of its integer part removed; a comma or underscore anywhere
    else (``1,5B``, ``1,2,3``, ``1_5B``, ``1,500_000``) is refused, never silently dropped."""
    if "," not in raw and "_" not in raw:
        return raw
    match = _GROUPED.match(raw)
    rest = raw[match.end():] if match else raw
    if match is None or "," in rest or "_" in rest:
        decimal = re.fullmatch(r"[+-]?[0-9]+[,_][0-9]+\s*[kKmMbBgGtT]", raw)  # 1,5B: a decimal comma
        fix = f"write {re.sub('[,_]', '.', raw)}" if decimal else "write the digits alone or with a suffix (1.5M)"
        raise ConfigError(f"{field} must be a count, got {v.quote(text)}: a comma or underscore may only separate "
                          f"groups of three digits (1,500,000 or 1_500_000); {fix}.")
    return match.group(1) + match.group(2).replace(",", "").replace("_", "") + rest


def parse_count(text, field: str = "params") -> int:
    """A positive count from ``7B``, ``1.3B``, ``350M``, ``13e9``, ``7000000000`` or an int.

    Suffixes K, M, B (or G) and T are powers of 1000 and are case-insensitive; ``,`` or ``_`` may separate
    the integer part into groups of three digits (``1,500,000``, ``7_000_000``, ``1,300.5M``), nowhere else.
    The value must come out to a whole number from 1 to ``MAX_COUNT``.
    """
    if isinstance(text, int) and not isinstance(text, bool):
        value = Decimal(text)
    else:
        raw = _without_separators(str(text).strip(), text, field)
        match = re.fullmatch(r"([0-9.eE+-]+)\s*([kKmMbBgGtT]?)", raw)
        try:
            if not match:
                raise InvalidOperation
            value = Decimal(match.group(1)) * _SUFFIX[match.group(2).upper()]
        except ArithmeticError:  # InvalidOperation, or Overflow for 1e1000000
            raise ConfigError(
                f"{field} must be a count such as 7B, 350M, 13e9 or 7000000000, got {v.quote(text)}."
            ) from None
    try:
        whole = value.is_finite() and 1 <= value <= MAX_COUNT and value == value.to_integral_value()
    except ArithmeticError:  # an exponent too large for the decimal context
        whole = False
    if not whole:
        raise ConfigError(f"{field} must be a whole number from 1 to 10^18, got {v.quote(text)}.")
    return int(value)


# --------------------------------------------------------------------------- optimizer-state offload
# With the optimizer offloaded (DeepSpeed's offload_optimizer: {device: cpu}), each rank's fp32 master shard
# and both Adam moments live in host memory, 4 + 4 + 4 bytes per parameter of its shard in either precision
# (with fp32 the device keeps the fp32 parameters it computes with, the host the master copy it steps), and
# so does the copy of the reduced gradient shard the host steps from (``FlatState.host_grad``: the model's
# gradient bytes, 2 in bf16, 4 in fp32), as in ZeRO-Offload: one arena per rank, exactly
# ``hybrid.plan.layout.host_arena_bytes`` (the engine allocates by it).
# The device keeps the parameters and gradients of its stage: 2Ψ/(t·N) + 2Ψ/(t·N) at stage 3 in bf16.
# Transients of the copies (one unit's gradient shard in flight) are left to the prediction model.
ADAM_STATE_KEYS = 2  # exp_avg, exp_avg_sq: the per-element state buffers the memory model counts


def host_bytes_per_param(precision: str, reduce_dtype: Optional[str] = None) -> int:
    """Host bytes per parameter of a rank's shard with the optimizer offloaded: master, moments, gradient."""
    return 12 + bytes_per_param(precision, reduce_dtype)[1]


@dataclass(frozen=True)
class OffloadBytes:
    """Per-rank bytes with the optimizer states offloaded: on the device (params + grads) and on the host."""

    device: int | float
    host: int | float


def offload_bytes(params: int, dp: int, stage: int, tp: int = 1, precision: str = DEFAULT_PRECISION,
                  reduce_dtype: Optional[str] = None) -> OffloadBytes:
    """Device and host bytes per rank at ZeRO ``stage`` (1-3) with the optimizer states in host memory (the
    host figure: the rank's host arena, ``host_arena_bytes``, for a shard of Ψ/(t·N) elements)."""
    states = model_state_bytes(params, dp, stage, tp, precision, reduce_dtype)
    if not policy_for(stage).shard_optimizer:
        raise ConfigError("optimizer offload needs ZeRO stage 1, 2 or 3 (stage 0 does not shard the optimizer "
                          "states); choose a stage from 1 to 3")
    device = Fraction(states.params) + Fraction(states.grads)
    grad_item = bytes_per_param(precision, reduce_dtype)[1]
    host = Fraction(host_arena_bytes(Fraction(params, tp * dp), grad_item, ADAM_STATE_KEYS))
    return OffloadBytes(_number(device), _number(host))


# ------------------------------------------------------------------------ optimizer states on NVMe
# With the optimizer offloaded to NVMe (DeepSpeed's offload_optimizer: {device: nvme}, ZeRO-Infinity), each
# rank's fp32 master shard and both Adam moments -- 12 bytes per parameter of its shard in either precision --
# are a swap file on the node's local disk (``hybrid.zero.nvme``, laid out by ``hybrid.plan.swap_layout``);
# the host keeps the copy of the reduced gradient shard the optimizer steps from (the gradient bytes, as with
# CPU offload: the rank's host arena, ``host_arena_bytes(..., nvme=True)``) and the store's record buffers:
# ``SWAP_BUFFERS`` records of the optimizer's batches, sized by the host's ``step_rule`` (at most
# ``sub_group_size`` elements; ``CONVERT_NUMEL`` with non-fp32 gradients), 12 bytes each (``swap_buffer_bytes``:
# a fixed cost per rank, not one that shrinks with DP). The
# device keeps what it keeps with CPU offload. A step reads and writes the whole file once: 12 bytes per
# parameter of the shard each way.
NVME_BYTES_PER_PARAM = 12


@dataclass(frozen=True)
class NvmeBytes:
    """Per-rank bytes with the optimizer states on NVMe: on the device, in host memory and on the disk."""

    device: int | float
    host: int | float
    disk: int | float


def nvme_offload_bytes(params: int, dp: int, stage: int, tp: int = 1, precision: str = DEFAULT_PRECISION,
                       reduce_dtype: Optional[str] = None,
                       sub_group_size: int = ZeroConfig.sub_group_size) -> NvmeBytes:
    """Device, host and disk bytes per rank at ZeRO ``stage`` (1-3) with the optimizer states on NVMe."""
    from hybrid.plan.swap_layout import swap_buffer_bytes

    split = offload_bytes(params, dp, stage, tp, precision, reduce_dtype)  # the device's share, and the stage check
    shard = Fraction(params, tp * dp)
    grad_item = bytes_per_param(precision, reduce_dtype)[1]
    grads = Fraction(host_arena_bytes(shard, grad_item, ADAM_STATE_KEYS, nvme=True))  # the arena: the gradient copy
    # the engine's records are its optimizer batches, sized by the host's step rule (the step runs on the CPU:
    # non-fp32 gradients cap them at CONVERT_NUMEL elements)
    buffers = swap_buffer_bytes(math.ceil(shard), step_rule("cpu", grad_item == FP32, sub_group_size).batch_numel)
    return NvmeBytes(split.device, _number(grads + buffers), _number(NVME_BYTES_PER_PARAM * shard))


# ------------------------------------------------------------------------------ the complete prediction
#
# What one rank holds at its peak, by category, following the engine's real layout rules
# (``hybrid.plan.layout``, which the engine builds by): units are gradient buckets of
# ``reduce_bucket_size`` elements at stages 0-2 and those of ``zero.stage3_unit`` at stage 3, with every parameter under
# ``param_persistence_threshold`` elements in one persistent unit that stays gathered; each parameter starts
# at a multiple of ``align`` elements (16 bytes) and each unit is padded to ``n_shards · align``.
#
# * model states: parameters, gradients, optimizer (fp32 master when the model dtype is not fp32, plus the
#   two Adam moments), exactly as the engine allocates them;
# * in flight: stage 2-3 gradient buckets (a unit-sized buffer per bucket, up to ``reduce_bucket_size``
#   elements awaiting their reduce-scatter, plus the one being filled) and stage-3 gathered units (the
#   largest unit plus ``prefetch_bucket_size`` elements prefetched);
# * optimizer transients: the reused fp32 scratch a non-fp32 gradient is converted into, one batch of at
#   most ``layout.batch_numel`` elements on the device (CPU: ``CONVERT_NUMEL``; a GPU converts a whole
#   sub-group, ``sub_group_size`` elements, the rank's shard by default, into it at once) (clipping
#   scales in place; the optimizer's state is the flat buffers from the start, so its first step allocates
#   none); the step runs after backward, so this competes with activations, not adds to them;
# * activations: the model's profile's (``profile_activation_bytes``);
# * runtime reserve: CUDA context, cuBLAS workspaces and NCCL buffers, outside every allocator statistic
#   (``DEFAULT_RUNTIME_RESERVE_GB``, overridable as ``cluster.runtime_reserve_gb``); on CPU, where the
#   figure measured is the process's RSS growth since the Context was made (with glibc returning freed
#   blocks, ``hybrid.plan.budget.follow_live_tensors``), what the engine build faults in beyond its tensors.
# Backward (``MemoryPrediction.backward_peak``): it starts with every activation and gathered unit alive and
# the first bucket being filled; each later bucket is filled while the activations and gathered units of
# the modules already back-propagated are freed, so the buckets in flight only dominate at the end, beside
# the unit still running. The first bucket counts whole on CUDA (allocated at once); on CPU a new bucket's
# pages are faulted in as gradients are written into it, so only the largest parameter's gradient counts.
# On CPU the gloo exchange's receive buffers and the kept stage 2-3 buckets come on top (``comm_buffers``).

DEFAULT_RUNTIME_RESERVE_GB = 1.5  # CUDA context ~0.5 GB, NCCL buffers and cuBLAS workspaces ~1 GB
# CPU: RSS growth beyond the tensors a rank's first steps hold at their peak (torch's thread pools and
# caches, autograd's and the optimizer's small blocks; libraries' code pages and torch's lazily imported
# runtime, torch._dynamo and sympy, are not counted: hybrid.plan.budget). At 53M parameters on torch 2.13 the
# prediction without it is within -8.6 % .. +8.9 % of the measured peak on DP 2 (tests/dist/
# test_memory_prediction.py): nothing measurable is left beyond the tensors. (75 MB while the meter still counted
# the ~70 MB of torch._dynamo that the first optimizer built imports.)
DEFAULT_CPU_RUNTIME_RESERVE_GB = 0.0
DTYPE_BYTES = {"bf16": 2, "fp32": 4}
FP32 = 4


@dataclass(frozen=True)
class MemoryPrediction:
    """Predicted bytes per rank, by category; ``peak`` is what the allocator reaches, ``total`` adds the
    runtime reserve (what NVML sees used)."""

    params: int
    grads: int
    optimizer: int
    gathered: int          # stage 3: units gathered at once (the running one and those prefetched)
    running_unit: int      # stage 3: the largest unit, gathered while its own gradients come in
    buckets: int           # stages 2-3: gradient buckets in flight at once
    first_bucket: int      # stages 2-3: what the first bucket holds while every activation is still alive
    optimizer_transient: int
    activations: int       # layers, logits and loss, at their peak (start of backward)
    runtime_reserve: int
    comm_buffers: int = 0  # CPU: the gloo exchange's receive buffers and stage 2-3 buckets, kept
    quantize_staging: int = 0  # int8 collectives: the packed and unpacked copies of the largest unit's, at once

    @property
    def model_states(self) -> int:
        return self.params + self.grads + self.optimizer

    @property
    def inflight(self) -> int:
        return self.gathered + self.buckets

    @property
    def backward_peak(self) -> int:
        """Activations, gathered units and buckets at the worst point of backward (see the notes above)."""
        return self.quantize_staging + max(self.gathered + self.activations + self.first_bucket,
                                           self.buckets + self.running_unit)

    @property
    def peak(self) -> int:
        # The optimizer step runs after backward has freed its activations, buckets and gathered units.
        return self.model_states + self.comm_buffers + max(self.backward_peak, self.optimizer_transient)

    @property
    def total(self) -> int:
        return self.peak + self.runtime_reserve

    def as_dict(self) -> dict:
        return {"params": self.params, "grads": self.grads, "optimizer": self.optimizer,
                "model_states": self.model_states, "inflight": self.inflight, "gathered": self.gathered,
                "running_unit": self.running_unit, "buckets": self.buckets, "first_bucket": self.first_bucket,
                "optimizer_transient": self.optimizer_transient, "activations": self.activations,
                "runtime_reserve": self.runtime_reserve, "comm_buffers": self.comm_buffers,
                "quantize_staging": self.quantize_staging, "peak": self.peak, "total": self.total}


def _as_units(units) -> ModelUnits:
    return units if isinstance(units, ModelUnits) else ModelUnits.from_lists(units)


def unit_layout(units, stage: int, dp: int, precision: str = DEFAULT_PRECISION,
                reduce_bucket_size: int = ZeroConfig.reduce_bucket_size,
                param_persistence_threshold: int = ZeroConfig.param_persistence_threshold):
    """``(FlatLayout, persistent unit indices)`` exactly as the engine builds it for this stage
    (``hybrid.plan.layout.stage_layout``); ``units`` is a ``ModelUnits`` or a list of per-unit numel lists."""
    units = _as_units(units)
    align = align_elements(DTYPE_BYTES[v.one_of("precision", precision, PRECISIONS)])
    layout, _, persistent = stage_layout(list(units.numels), [list(u) for u in units.stage3_units],
                                         policy_for(v.stage("stage", stage)), dp, align, reduce_bucket_size,
                                         param_persistence_threshold)
    return layout, persistent


def shard_topology(dp: int, stage: int, zero=None, dp_per_node: int | None = None) -> ShardTopology:
    """How ``zero``'s options cut a DP group of ``dp`` ranks, ``dp_per_node`` of them on each node (default: one
    node), as the engine cuts it (``hybrid.plan.links.ShardTopology``; one sentence where they cannot)."""
    zero = zero or ZeroConfig()
    dp = _positive_int(dp, "dp")
    per = dp if dp_per_node is None else _positive_int(dp_per_node, "dp_per_node")
    nodes = [r // per for r in range(dp)]
    policy = policy_for(v.stage("stage", stage))
    if not policy.shard_optimizer:
        return ShardTopology.of(nodes)
    return ShardTopology.of(nodes, zero.shard_group, zero.hierarchical,
                            zero.secondary_shard if policy.shard_params else "none")


def predict_memory(units, dp: int, stage: int, precision: str = DEFAULT_PRECISION, *,
                   activations: float = 0, zero=None,
                   runtime_reserve: float = 0, device: str = "cuda", dp_per_node: int | None = None) -> MemoryPrediction:
    """Predicted per-rank bytes of the engine at ``stage`` on ``dp`` ranks (``dp_per_node`` of them on each node;
    default one node, which only ``zero.shard_group: node`` and the other link options read) for a model whose
    trainable parameters are ``units`` (``hybrid.zero.units.model_units``, made with the ``stage3_unit`` of
    ``zero``); ``zero`` is a ``hybrid.config.ZeroConfig`` (default sizes when None), ``activations`` the bytes of
    one micro-batch's activations (``profile_activation_bytes``); ``device`` "cpu" predicts the peak RSS growth instead of the CUDA allocator's
    peak."""
    zero = zero or ZeroConfig()
    policy = policy_for(v.stage("stage", stage))
    dp = _positive_int(dp, "dp")
    topo = shard_topology(dp, stage, zero, dp_per_node)
    param_numels = _as_units(units).numels
    layout, persistent = unit_layout(units, stage, topo.shard, precision, zero.reduce_bucket_size,
                                     zero.param_persistence_threshold)
    item = DTYPE_BYTES[precision]
    grad_item = DTYPE_BYTES[zero.reduce_dtype or precision]  # gradients and their buckets
    shard, full = layout.shard_numel, layout.full_numel
    units = [u.numel for u in layout.units]
    if policy.kept_gathered == "persistent":  # the shard, and the persistent unit gathered
        params = (shard + sum(units[u] for u in persistent)) * item
        if topo.secondary > 1:  # hpZ: 1/h of every unit gathered in forward and backward
            params += sum(n // topo.secondary for u, n in enumerate(units) if u not in persistent) * item
    else:
        params = full * item
    grads = (shard if policy.shard_grads else full) * grad_item
    master = 0 if precision == "fp32" else shard * FP32
    optimizer = master + 2 * shard * FP32

    buckets = first_bucket = gathered = running_unit = 0
    if policy.bucket_buffers:  # unit-sized buckets wait for their reduce-scatter, up to reduce_bucket_size elements
        buckets = _waiting_buckets(units, zero.reduce_bucket_size) * grad_item
        first_bucket = min(max(units), max(param_numels, default=0)) if device == "cpu" else max(units)
        first_bucket *= grad_item
    if policy.shard_params:  # units gathered around forward and backward
        others = sorted((n for u, n in enumerate(units) if u not in persistent), reverse=True)
        if others:
            prefetched, budget = 0, zero.prefetch_bucket_size
            for n in others[1:]:
                if n > budget:
                    break
                budget -= n
                prefetched += n
            gathered, running_unit = (others[0] + prefetched) * item, others[0] * item
    piece = min(batch_numel(zero.sub_group_size, grad_item == FP32, device), layout.shard_numel)
    transient = piece * FP32 if grad_item != FP32 else 0  # the fp32 scratch of non-fp32 gradients
    comm_buffers = 0
    if device == "cpu":
        comm_buffers = (_cpu_comm_bytes(units, topo.shard, stage, item, grad_item)
                        + kept_bucket_numel(units, stage) * grad_item)
    return MemoryPrediction(int(params), int(grads), int(optimizer), int(gathered), int(running_unit), int(buckets),
                            int(first_bucket),
                            int(transient), int(activations), int(runtime_reserve), int(comm_buffers),
                            int(_quantize_staging(max(units), topo, zero)))


def _quantize_staging(unit: int, topo: ShardTopology, zero) -> int:
    """Bytes the int8 collectives of a unit of ``unit`` elements hold at once (``hybrid.comm.sharded``): a gather
    receives every packed shard (one byte each and the scales) and unpacks them in fp32; a reduce-scatter packs
    its input (an fp32 copy, int8, the packed bytes) and receives as many, unpacked in fp32. Hierarchical: the
    level across nodes only, over the node's 1/k of the unit."""
    if topo.hierarchical:
        unit //= topo.spans().intra.size
    weights = unit * (1 + FP32) if zero.quantized_weights != "none" else 0
    grads = unit * (FP32 + 1 + 1 + 1 + FP32) if zero.quantized_gradients != "none" else 0
    return max(weights, grads)


def _cpu_comm_bytes(units: list, dp: int, stage: int, item: int, grad_item: int) -> int:
    """Bytes ``hybrid.comm`` keeps for the collectives of ``units`` on CPU: gloo's exchange buffers where the
    DP ranks are on different hosts; where they share one, those of the collectives below ``SHM_MIN_BYTES``
    plus the shared-memory pages of the larger ones (``hybrid.comm.shm``), both as ``hybrid.plan.layout``
    sizes them. The larger of the two."""
    if dp <= 1:
        return 0
    across_hosts = exchange_numel(units, dp, stage) * grad_item
    widest = max(item, grad_item)  # a unit's largest collective: its parameters' all-gather or its gradients'
    small = [n for n in units if n * grad_item < SHM_MIN_BYTES]
    large = [n * widest for n in units if n * widest >= SHM_MIN_BYTES]
    one_host = exchange_numel(small, dp, stage) * grad_item + resident_bytes(dp, max(large, default=0))
    return max(across_hosts, one_host)


def _waiting_buckets(units: list, cap: int) -> int:
    """Elements of gradient buckets alive at once: the largest being filled plus up to ``cap`` waiting."""
    order = sorted(units, reverse=True)
    waiting = 0
    for n in order[1:]:
        if waiting + n > cap:
            break
        waiting += n
    return order[0] + waiting


def profile_activation_bytes(plain, checkpointed, seq: int, micro_batch: int, tp: int = 1,
                             checkpointing: bool = False, logits_split: bool = False) -> int:
    """Activation bytes per GPU at the start of backward (the peak) for one micro-batch of ``seq`` tokens, from
    the model's measured profiles (``hybrid.plan.profile.ModelProfile``: ``plain`` without, ``checkpointed``
    with activation checkpointing), both taken of the unsplit model.

    Without checkpointing: every block's saved bytes and what is saved outside them (embeddings, final norm,
    the head's input, logits and loss). With it: what each block's checkpoint keeps (its inputs), the outside,
    and one block's plain bytes alive again while it is recomputed in backward.

    At TP t this is an approximation (the profile did not run split): of a block, the bytes saved with the
    residual stream's width (``block_whole_bytes``: its input, norms, residual sums, and the input of its
    row-parallel projection, counted whole though it is split) stay whole on every rank and the rest
    (heads, MLP columns) is 1/t; what a checkpoint keeps and the outside stay whole, except the head's bytes,
    which are 1/t where the logits are split by vocabulary (``logits_split``: a vocab-parallel head and loss,
    as the built-in GPT's and a Hugging Face causal LM's where ``hybrid.tp.splits_logits`` says so) and whole
    where every rank gathers them (a head whose forward cannot keep them split).
    """
    s, b, t = _positive_int(seq, "seq"), _positive_int(micro_batch, "micro_batch"), _positive_int(tp, "tp")

    def block_at_tp(profile) -> float:
        whole = profile.block_whole_bytes(b, s)
        return whole + (profile.block_bytes(b, s) - whole) / t

    chosen = checkpointed if checkpointing else plain
    head = chosen.head_bytes(b, s)
    outside = chosen.activation_bytes(b, s) - chosen.layers * chosen.block_bytes(b, s) - head
    head = head / t if logits_split else head
    if checkpointing:
        blocks = chosen.layers * chosen.block_bytes(b, s) + block_at_tp(plain)
    else:
        blocks = chosen.layers * block_at_tp(chosen)
    return max(0, int(blocks + outside + head))
