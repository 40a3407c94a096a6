"""The seed's memory model: per-GPU model-state bytes for ZeRO stages 0-3, plus an activation estimate.

Model states (zero-stages.txt, sections 1-4). With Ψ parameters, tensor-parallel degree t and data-parallel
degree N, every GPU holds Ψ/t parameters before ZeRO; ZeRO then divides, per stage:

    stage 0: P·Ψ/t       + G·Ψ/t       + O·Ψ/t
    stage 1: P·Ψ/t       + G·Ψ/t       + O·Ψ/(t·N)     optimizer states sharded
    stage 2: P·Ψ/t       + G·Ψ/(t·N)   + O·Ψ/(t·N)     + gradients sharded
    stage 3: P·Ψ/(t·N)   + G·Ψ/(t·N)   + O·Ψ/(t·N)     + parameters sharded

where (P, G, O) bytes per parameter are (2, 2, 12) for bf16 mixed precision (bf16 params and grads; fp32
master weights, momentum and variance) and (4, 4, 8) for plain fp32 (the fp32 params are the master copy).

The arithmetic is exact (fractions), so the seed's tables come out to the digit: 7B on 8 GPUs gives
112 / 38.5 / 26.25 / 14 GB. Each byte count is returned as an ``int`` when it is a whole number and as the
correctly rounded ``float`` otherwise. GB here means 10^9 bytes, as in the seed.

Activations (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models"),
bytes per transformer layer for sequence length s, micro-batch b, hidden size h, a attention heads:

    s·b·h·(10 + 24/t + 5·a·s/(h·t))     (t = 1 gives the no-TP form s·b·h·(34 + 5·a·s/h))
    2·s·b·h                             with full activation checkpointing (only each layer's input kept)
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from fractions import Fraction

from hybrid import validate as v
from hybrid.errors import ConfigError
from hybrid.validate import PRECISIONS, STAGES

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


def model_state_bytes(
    params: int, dp: int, stage: int, tp: int = 1, precision: str = "bf16"
) -> ModelStateBytes:
    """Per-GPU bytes of parameters, gradients and optimizer states at ZeRO ``stage``."""
    params = _positive_int(params, "params")
    dp = _positive_int(dp, "dp")
    tp = _positive_int(tp, "tp")
    v.stage("stage", stage)
    p_bytes, g_bytes, o_bytes = _check_precision(precision)

    local = Fraction(params, tp)  # what one GPU holds before ZeRO
    shard = local / dp
    p = p_bytes * (shard if stage >= 3 else local)
    g = g_bytes * (shard if stage >= 2 else local)
    o = o_bytes * (shard if stage >= 1 else local)
    return ModelStateBytes(_number(p), _number(g), _number(o), _number(p + g + o))


def all_stages(params: int, dp: int, tp: int = 1, precision: str = "bf16") -> dict[int, ModelStateBytes]:
    """``model_state_bytes`` for every stage, keyed 0..3."""
    return {stage: model_state_bytes(params, dp, stage, tp, precision) for stage in STAGES}


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


def parse_count(text, field: str = "params") -> int:
    """A positive count from ``7B``, ``1.3B``, ``350M``, ``13e9``, ``7000000000`` or an int.

    Suffixes K, M, B (or G) and T are powers of 1000 and are case-insensitive; ``_`` and ``,`` separators
    are allowed. The value must come out to a whole number from 1 to ``MAX_COUNT``.
    """
    if isinstance(text, int) and not isinstance(text, bool):
        value = Decimal(text)
    else:
        raw = str(text).strip().replace("_", "").replace(",", "")
        match = re.fullmatch(r"([0-9.eE+-]+)\s*([kKmMbBgGtT]?)", raw)
        try:
            if not match:
                raise InvalidOperation
            value = Decimal(match.group(1)) * _SUFFIX[match.group(2).upper()]
        except ArithmeticError:  # InvalidOperation, or Overflow for 1e1000000
            raise ConfigError(
                f"{field} must be a count such as 7B, 350M, 13e9 or 7000000000, got {v.quote(text)}"
            ) from None
    try:
        whole = value.is_finite() and 1 <= value <= MAX_COUNT and value == value.to_integral_value()
    except ArithmeticError:  # an exponent too large for the decimal context
        whole = False
    if not whole:
        raise ConfigError(f"{field} must be a whole number from 1 to 10^18, got {v.quote(text)}")
    return int(value)


# --------------------------------------------------------------------------- optimizer-state offload
# With the optimizer offloaded (DeepSpeed's offload_optimizer: {device: cpu}), each rank's fp32 master shard
# and both Adam moments live in host memory: 4 + 4 + 4 bytes per parameter of its shard in either precision
# (with fp32 the device keeps the fp32 parameters it computes with, the host the master copy it steps).
# The device keeps the parameters and gradients of its stage: 2Ψ/(t·N) + 2Ψ/(t·N) at stage 3 in bf16.
# Transients of the copies (one unit's gradient shard in flight) are left to the prediction model.
HOST_BYTES_PER_PARAM = 12


@dataclass(frozen=True)
class OffloadBytes:
    """Per-rank bytes with the optimizer states offloaded: on the device (params + grads) and on the host."""

    device: int | float
    host: int | float


def offload_bytes(params: int, dp: int, stage: int, tp: int = 1, precision: str = "bf16") -> OffloadBytes:
    """Device and host bytes per rank at ZeRO ``stage`` (1-3) with the optimizer states in host memory."""
    states = model_state_bytes(params, dp, stage, tp, precision)
    if stage == 0:
        raise ConfigError("optimizer offload needs ZeRO stage 1, 2 or 3 (stage 0 does not shard the optimizer "
                          "states); choose a stage from 1 to 3")
    device = Fraction(states.params) + Fraction(states.grads)
    host = Fraction(HOST_BYTES_PER_PARAM * params, tp * dp)
    return OffloadBytes(_number(device), _number(host))
