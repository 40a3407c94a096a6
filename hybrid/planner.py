"""The seed's stage-selection guide as a pure function: which ZeRO stage to run, and why.

A stage fits when its per-GPU model states plus the activation estimate are at most
``gpu_memory_bytes · (1 − headroom)``. The rules, in order (zero-stages.txt, "Stage Selection Guide"):

1. DP degree 1 and stage 0 fits → stage 0: there is nothing to shard across data-parallel ranks.
2. Stage 0 fits ("fits with standard DP") → stage 1: same traffic as DP, less memory.
3. Otherwise the lowest stage that fits: 1 ("OOM with standard DP, fits with optimizer sharding"),
   2 ("still OOM with sharded optimizer, fits with gradient sharding"), 3 ("does not fit even with sharded
   optimizer and gradients: parameters sharded too").
4. Nothing fits → stage 3 with the optimizer states offloaded to CPU, if stage 3's parameters and gradients
   fit ("too large even for ZeRO-3: ZeRO-3 with CPU offload of optimizer states").
5. Else ``PlanError`` naming the smallest GPU count (at the same TP degree) that would fit.

``forced_stage`` overrides the choice; the plan still reports what fits, and the reason says so when the
forced stage does not.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction

from hybrid import validate as v
from hybrid.errors import PlanError
from hybrid.memory import BYTES_PER_PARAM, ModelStateBytes, all_stages
from hybrid.validate import STAGES

ROW_STANDARD_DP = "fits with standard DP"
ROW_STAGE1 = "OOM with standard DP, fits with optimizer sharding"
ROW_STAGE2 = "still OOM with sharded optimizer, fits with gradient sharding"
ROW_STAGE3 = "does not fit even with sharded optimizer and gradients: parameters sharded too"
ROW_OFFLOAD = "too large even for ZeRO-3: ZeRO-3 with CPU offload of optimizer states"
_ROW_FOR_STAGE = {1: ROW_STAGE1, 2: ROW_STAGE2, 3: ROW_STAGE3}


@dataclass(frozen=True)
class Plan:
    """The chosen stage, whether optimizer states go to CPU, and the per-stage table behind the choice."""

    stage: int
    offload: bool
    reason: str
    stages: dict[int, ModelStateBytes]
    fits: dict[int, bool]
    dp: int
    tp: int
    gpu_memory_bytes: float
    activation_bytes: float = 0.0
    headroom: float = 0.1

    @property
    def usable_bytes(self) -> float:
        return float(_usable(self.gpu_memory_bytes, self.headroom))

    @property
    def per_gpu_bytes(self) -> float:
        """Bytes per GPU of the chosen plan: model states on the GPU plus activations."""
        states = self.stages[self.stage]
        on_gpu = states.params + states.grads if self.offload else states.total
        return float(Fraction(on_gpu) + Fraction(self.activation_bytes))


def _gb(value) -> str:
    """Decimal units as the seed writes them (208 GB, 71.5 GB), stepping down for small models so two
    different sizes never print alike."""
    exact = Fraction(value)
    for scale, unit in ((10**9, "GB"), (10**6, "MB"), (10**3, "KB")):
        if abs(exact) >= scale:
            break
    else:
        scale, unit = 1, "B"
    text = f"{float(exact / scale):.3f}".rstrip("0").rstrip(".")
    return f"{text} {unit}"


def _usable(gpu_memory_bytes, headroom) -> Fraction:
    # str() keeps a decimal headroom such as 0.1 exact instead of its binary approximation.
    return Fraction(gpu_memory_bytes) * (1 - Fraction(str(headroom)))


def _validate(dp, tp, gpu_memory_bytes, activation_bytes, headroom, forced_stage) -> None:
    v.positive_int("dp", dp)
    v.positive_int("tp", tp)
    v.positive_number("gpu_memory_bytes", gpu_memory_bytes, unit="bytes")
    check_headroom("headroom", headroom)
    v.number("activation_bytes", activation_bytes, lo=0, unit="bytes")
    if forced_stage is not None:
        v.stage("zero stage", forced_stage)


def check_headroom(path: str, headroom) -> float:
    """The fraction of GPU memory kept free: in [0, 1)."""
    need = "a fraction in [0, 1), e.g. 0.1 keeps 10% free"
    value = v.number(path, headroom, 0, 1, need=need)
    if value == 1:
        raise v.invalid(path, need, headroom)
    return value


def _min_dp(bytes_per_param: int, params: int, tp: int, room: Fraction) -> int:
    """Smallest DP degree at which ``bytes_per_param · Ψ / (tp · dp)`` fits in ``room``."""
    return max(1, math.ceil(Fraction(bytes_per_param * params, tp) / room))


def _no_fit_error(params, dp, tp, precision, usable: Fraction, activations: Fraction) -> PlanError:
    room = usable - activations
    if room <= 0:
        return PlanError(
            f"activations alone need {_gb(activations)} per GPU but only {_gb(usable)} is usable: "
            "lower seq or micro-batch, enable activation checkpointing, or raise tp"
        )
    p_bytes, g_bytes, o_bytes = BYTES_PER_PARAM[precision]
    kept = p_bytes + g_bytes  # per parameter on the GPU with the optimizer states on CPU
    full = p_bytes + g_bytes + o_bytes
    gpus_offload = _min_dp(kept, params, tp, room) * tp
    gpus_zero3 = _min_dp(full, params, tp, room) * tp
    gpus = f"{dp * tp} GPU{'s' if dp * tp > 1 else ''}"
    return PlanError(
        f"{params:,} parameters do not fit on {gpus} (tp={tp}, {_gb(usable)} usable each) even with "
        f"ZeRO-3 and CPU offload: use at least {gpus_offload} GPUs ({gpus_zero3} without offload) or GPUs "
        "with more memory"
    )


def choose_stage(
    params: int,
    dp: int,
    tp: int,
    gpu_memory_bytes: float,
    precision: str = "bf16",
    activation_bytes: float = 0.0,
    headroom: float = 0.1,
    forced_stage: int | None = None,
) -> Plan:
    """Pick the ZeRO stage (and CPU offload) for Ψ=``params`` on a dp × tp mesh; see the module docstring."""
    _validate(dp, tp, gpu_memory_bytes, activation_bytes, headroom, forced_stage)
    stages = all_stages(params, dp, tp, precision)
    usable = _usable(gpu_memory_bytes, headroom)
    activations = Fraction(activation_bytes)
    needs = {s: Fraction(stages[s].total) + activations for s in STAGES}
    fits = {s: needs[s] <= usable for s in STAGES}

    def plan(stage: int, offload: bool, reason: str) -> Plan:
        return Plan(
            stage, offload, reason, stages, fits, dp, tp, gpu_memory_bytes, activation_bytes, headroom
        )

    budget = f"{_gb(usable)} usable per GPU"
    if forced_stage is not None:
        stage = forced_stage
        verdict = "" if fits[stage] else ", but it does not fit"
        return plan(stage, False, f"stage {stage} as requested{verdict}: needs {_gb(needs[stage])} of {budget}")

    if fits[0] and dp == 1:
        reason = f"{ROW_STANDARD_DP} and DP degree is 1, nothing to shard: needs {_gb(needs[0])} of {budget}"
        return plan(0, False, reason)
    if fits[0]:
        return plan(
            1,
            False,
            f"{ROW_STANDARD_DP}: stage 1 has the same traffic as DP and less memory "
            f"({_gb(needs[1])} instead of {_gb(needs[0])} of {budget})",
        )
    for stage in (1, 2, 3):
        if fits[stage]:
            return plan(
                stage,
                False,
                f"{_ROW_FOR_STAGE[stage]}: stage {stage - 1} needs {_gb(needs[stage - 1])}, "
                f"stage {stage} {_gb(needs[stage])} of {budget}",
            )

    offloaded = Fraction(stages[3].params) + Fraction(stages[3].grads) + activations
    if offloaded <= usable:
        return plan(
            3,
            True,
            f"{ROW_OFFLOAD}: stage 3 needs {_gb(needs[3])}, {_gb(offloaded)} with the optimizer on CPU, "
            f"of {budget}",
        )
    raise _no_fit_error(params, dp, tp, precision, usable, activations)
