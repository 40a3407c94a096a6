"""The seed's stage-selection guide as a pure function, with both memory levers: which ZeRO stage to run,
whether activations are checkpointed and the optimizer states offloaded to the host, and why.

An option fits when its per-GPU bytes (model states on the device plus the activation estimate, the
checkpointed one with activation checkpointing) are at most ``gpu_memory_bytes · (1 − headroom)`` and, with
offload, the host bytes of a node's ranks (12 B per parameter of each rank's shard: fp32 master and both
moments, ``hybrid.plan.memory.offload_bytes``) are at most ``host_memory_bytes · (1 − headroom)`` when the host
memory is known. The options are tried in the order that costs least (zero-stages.txt, "Stage Selection
Guide", and its last row "Extremely large model → ZeRO-3 + offloading"):

1. DP degree 1 and stage 0 fits → stage 0: there is nothing to shard across data-parallel ranks.
2. Stage 0 fits ("fits with standard DP") → stage 1: same traffic as DP, less memory.
3. Otherwise the lowest stage that fits: 1 ("OOM with standard DP, fits with optimizer sharding"),
   2 ("still OOM with sharded optimizer, fits with gradient sharding"), 3 ("does not fit even with sharded
   optimizer and gradients: parameters sharded too").
4. Stage 3 with activation checkpointing (recompute costs compute, no memory traffic).
5. Stage 3 with the optimizer states offloaded to CPU, then offload with activation checkpointing.
6. Where a disk is declared (``nvme``) or NVMe offload is asked for: stage 3 with the optimizer states
   offloaded to NVMe (ZeRO-Infinity's ``offload_optimizer: {device: nvme}``), then with activation
   checkpointing -- the host keeps only the gradient copy and the swap store's buffers
   (``hybrid.plan.memory.nvme_offload_bytes``), the states go to a swap file per rank, 12 B per parameter of
   its shard, which a node's ranks must find room for on its disk (``nvme_bytes · (1 − headroom)``) when
   that is known.
7. Else ``PlanError`` naming the smallest GPU count (at the same TP degree) that would fit, or saying that
   the host memory (or, with NVMe offload, the disk) is what is too small. The count is a whole number of
   nodes: a multiple of the TP degree (DP = GPUs / tp) and of ``ranks_per_node`` (the ranks on one node,
   sharing its host memory and disk), said as ``3 nodes (24 GPUs)`` unless ``node_size_known`` is False
   (``ranks_per_node`` is then only the ranks known to share a node, such as a TP group, and the count is
   said in GPUs).

``activation_checkpointing`` and ``offload`` are None (auto: the planner's choice, as above), True (always
on: every option has it) or False (never); ``offload`` may also be ``"nvme"`` (every option offloads to NVMe).
Activation checkpointing is an option only when the checkpointed estimate (``checkpointed_activation_bytes``)
is given and smaller. ``forced_stage`` fixes the stage; the
levers left on auto are still used at that stage when it does not fit without them, and the reason says so
when nothing makes it fit. Offload with stage 0 is refused (``check_offload_stage``): stage 0 shards nothing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction
from typing import Optional

from hybrid.config import validate as v
from hybrid.config.stage_policy import policy_for
from hybrid.errors import ConfigError, PlanError
from hybrid.plan.memory import (ModelStateBytes, all_stages, bytes_per_param, host_bytes_per_param, nvme_offload_bytes,
                                offload_bytes)
from hybrid.config.units import human_bytes as _gb
from hybrid.config.validate import DEFAULT_PRECISION, STAGES

# The largest GPU count the planner suggests or takes (``hybrid estimate --gpus``): beyond any real cluster.
MAX_GPUS = 10**7

ROW_STANDARD_DP = "fits with standard DP"
ROW_STAGE1 = "OOM with standard DP, fits with optimizer sharding"
ROW_STAGE2 = "still OOM with sharded optimizer, fits with gradient sharding"
ROW_STAGE3 = "does not fit even with sharded optimizer and gradients: parameters sharded too"
ROW_AC = "does not fit even with ZeRO-3: ZeRO-3 with activation checkpointing (blocks recomputed in backward)"
ROW_OFFLOAD = "too large even for ZeRO-3: ZeRO-3 with CPU offload of optimizer states"
ROW_OFFLOAD_AC = ROW_OFFLOAD + " and activation checkpointing"
ROW_NVME = ("too large for ZeRO-3 with CPU offload (the host memory): ZeRO-3 with the optimizer states offloaded to "
            "NVMe (ZeRO-Infinity)")
ROW_NVME_AC = ROW_NVME + " and activation checkpointing"
DEFAULT_SUB_GROUP_SIZE = 1_000_000_000  # hybrid.config.training.ZeroConfig.sub_group_size: the swap buffers' records
_ROW_FOR_STAGE = {1: ROW_STAGE1, 2: ROW_STAGE2, 3: ROW_STAGE3}
# The stages that shard the optimizer states, so can offload them (stage 0 keeps them whole on every rank).
OFFLOAD_STAGES = tuple(s for s in STAGES if policy_for(s).shard_optimizer)


@dataclass(frozen=True)
class Option:
    """One way to run: a stage and its levers, with what it needs per GPU and per node's host."""

    stage: int
    activation_checkpointing: bool
    offload: bool
    device_bytes: float  # model states on the GPU plus activations
    host_bytes: float  # per rank: the offloaded optimizer states (0 without offload)
    fits: bool  # on the GPU and, with offload, in the host memory (and the disk) when known
    host_fits: Optional[bool] = None  # None: no offload, or host memory unknown
    nvme: bool = False  # the offloaded states on the node's disk (NVMe), not in host memory
    disk_bytes: float = 0.0  # per rank: the swap file (0 without NVMe offload)
    disk_fits: Optional[bool] = None  # None: no NVMe offload, or the disk's space unknown

    @property
    def label(self) -> str:
        return f"{self.stage}" + (" + nvme" if self.nvme else " + offload" if self.offload else "") + \
            (" + AC" if self.activation_checkpointing else "")


@dataclass(frozen=True)
class Plan:
    """The chosen stage and levers, the per-stage table and the options behind the choice."""

    stage: int
    offload: bool
    reason: str
    stages: dict[int, ModelStateBytes]
    fits: dict[int, bool]  # per stage without offload, activations as the levers leave them by default
    dp: int
    tp: int
    gpu_memory_bytes: float
    activation_bytes: float = 0.0  # the estimate without checkpointing
    headroom: float = 0.1
    activation_checkpointing: bool = False
    checkpointed_activation_bytes: Optional[float] = None
    host_bytes: float = 0.0  # per rank, with offload
    host_memory_bytes: Optional[float] = None  # per node; None: unknown, not checked
    ranks_per_node: int = 1
    options: tuple = ()  # the Options tried, in order
    nvme: bool = False  # the offloaded states on each node's disk (offload is True too)
    disk_bytes: float = 0.0  # per rank, with NVMe offload: its swap file
    nvme_bytes: Optional[float] = None  # per node: the disk's space for the swap files; None: unknown

    @property
    def usable_bytes(self) -> float:
        return float(_usable(self.gpu_memory_bytes, self.headroom))

    @property
    def chosen_activation_bytes(self) -> float:
        """Activations per GPU of the chosen plan (the checkpointed estimate with activation checkpointing)."""
        if self.activation_checkpointing and self.checkpointed_activation_bytes is not None:
            return self.checkpointed_activation_bytes
        return self.activation_bytes

    @property
    def per_gpu_bytes(self) -> float:
        """Bytes per GPU of the chosen plan: model states on the GPU plus activations."""
        states = self.stages[self.stage]
        on_gpu = Fraction(states.params) + Fraction(states.grads) if self.offload else Fraction(states.total)
        return float(on_gpu + Fraction(self.chosen_activation_bytes))

    @property
    def host_bytes_per_node(self) -> float:
        return float(Fraction(self.host_bytes) * self.ranks_per_node)

    @property
    def disk_bytes_per_node(self) -> float:
        return float(Fraction(self.disk_bytes) * self.ranks_per_node)

    @property
    def offload_device(self) -> str:
        """Where the optimizer states live: ``none`` (the GPU), ``cpu`` or ``nvme`` (the config's words)."""
        return "nvme" if self.nvme else "cpu" if self.offload else "none"


def _usable(memory_bytes, headroom) -> Fraction:
    # str() keeps a decimal headroom such as 0.1 exact instead of its binary approximation.
    return Fraction(memory_bytes) * (1 - Fraction(str(headroom)))


def check_headroom(path: str, headroom) -> float:
    """The fraction of GPU memory kept free: in [0, 1)."""
    need = "a fraction in [0, 1), e.g. 0.1 keeps 10% free"
    value = v.number(path, headroom, 0, 1, need=need)
    if value == 1:
        raise v.invalid(path, need, headroom)
    return value


def check_lever(path: str, value) -> Optional[bool]:
    """``auto`` (or None) → None, else a boolean."""
    if value is None or value == "auto":
        return None
    if not isinstance(value, bool):
        raise v.invalid(path, "auto, true or false", value)
    return value


OFFLOAD_NVME = "nvme"  # the offload lever's third value: the optimizer states on each node's local disk


def check_offload(path: str, value):
    """The offload lever: ``auto`` (or None) → None, a boolean (true: host memory), or ``nvme``."""
    if isinstance(value, str) and value == OFFLOAD_NVME:
        return OFFLOAD_NVME
    if value is None or value == "auto":
        return None
    if not isinstance(value, bool):
        raise v.invalid(path, "auto, true (host memory), nvme (each node's local disk) or false", value)
    return value


def check_offload_stage(offload, stage: Optional[int], offload_path: str = "offload",
                        stage_path: str = "zero stage") -> None:
    """Offload forced on with stage 0 forced is refused: stage 0 keeps every optimizer state on every rank."""
    if offload and stage is not None and not policy_for(stage).shard_optimizer:
        value = offload if isinstance(offload, str) else "true"
        raise ConfigError(f"{offload_path} is {value} but {stage_path} is 0: offloading moves each rank's shard of "
                          f"the optimizer states to the host, and stage 0 shards nothing; use stage 1, 2 or 3, or set "
                          f"{offload_path} to auto or false.")


def _validate(dp, tp, gpu_memory_bytes, activation_bytes, headroom, forced_stage, checkpointed, offload, ac,
              host_memory_bytes, ranks_per_node, node_size_known, nvme_bytes=None, sub_group_size=1) -> None:
    v.positive_int("dp", dp)
    v.positive_int("tp", tp)
    v.positive_number("gpu_memory_bytes", gpu_memory_bytes, unit="bytes")
    check_headroom("headroom", headroom)
    v.number("activation_bytes", activation_bytes, lo=0, unit="bytes")
    if checkpointed is not None:
        v.number("checkpointed_activation_bytes", checkpointed, lo=0, unit="bytes")
    if forced_stage is not None:
        v.stage("zero stage", forced_stage)
    check_offload("offload", offload)
    check_lever("activation_checkpointing", ac)
    if host_memory_bytes is not None:
        v.positive_number("host_memory_bytes", host_memory_bytes, unit="bytes")
    v.positive_int("ranks_per_node", ranks_per_node)
    v.boolean("node_size_known", node_size_known)
    if nvme_bytes is not None:
        v.positive_number("nvme_bytes", nvme_bytes, unit="bytes")
    v.positive_int("sub_group_size", sub_group_size)
    check_offload_stage(check_offload("offload", offload), forced_stage)


def quantity(count: int, noun: str) -> str:
    """``count`` with its thousands separated and ``noun`` in the number it takes: ``1 GPU``, ``24 GPUs``,
    ``10,000,000 GPUs``, ``1 parameter``. Every count the planner and ``hybrid estimate`` print goes through it."""
    return f"{count:,} {noun}{'' if count == 1 else 's'}"


def _gpus_needed(gpus: int, tp: int, ranks_per_node: int, node_size_known: bool) -> str:
    """The smallest count of at least ``gpus`` GPUs that makes a mesh, as text: a multiple of the TP degree
    (DP = GPUs / tp) and, since a cluster grows by whole nodes, of ``ranks_per_node``, said in nodes when the
    node size is known: ``3 nodes (24 GPUs)``, ``23 GPUs``, or ``more than 10,000,000 GPUs`` past any cluster
    the planner reasons about."""
    step = math.lcm(tp, ranks_per_node)
    gpus = -(-gpus // step) * step
    if gpus > MAX_GPUS:
        return f"more than {quantity(MAX_GPUS, 'GPU')}"
    if node_size_known and ranks_per_node > 1:
        return f"{quantity(gpus // ranks_per_node, 'node')} ({quantity(gpus, 'GPU')})"
    return quantity(gpus, "GPU")


def _min_dp(bytes_per_param: int, params: int, tp: int, room: Fraction) -> int:
    """Smallest DP degree at which ``bytes_per_param · Ψ / (tp · dp)`` fits in ``room``."""
    return max(1, math.ceil(Fraction(bytes_per_param * params, tp) / room))


def _no_fit_error(params, dp, tp, precision, usable: Fraction, activations: Fraction, offload_allowed: bool,
                  with_ac: bool, ranks_per_node: int, node_size_known: bool,
                  host_usable: Optional[Fraction], reduce_dtype: Optional[str] = None) -> PlanError:
    room = usable - activations
    ac = " with activation checkpointing" if with_ac else ""
    if room <= 0:
        fix = ("lower the sequence length (model.seq_len, --seq) or the micro-batch (job.micro_batch, "
               "--micro-batch), " + ("" if with_ac else "enable activation checkpointing "
                                     "(parallel.activation_checkpointing), ") +
               "raise the TP degree (parallel.tp, --tp) or use GPUs with more memory (cluster.gpu_memory_gb)")
        return PlanError(f"activations{ac} alone need {_gb(activations)} per GPU but only {_gb(usable)} is "
                         f"usable: {fix}.")
    p_bytes, g_bytes, o_bytes = bytes_per_param(precision, reduce_dtype)

    def needed(dp_needed: int) -> str:
        return _gpus_needed(dp_needed * tp, tp, ranks_per_node, node_size_known)

    zero3 = needed(_min_dp(p_bytes + g_bytes + o_bytes, params, tp, room))
    what = (f"{quantity(params, 'parameter')} {'does' if params == 1 else 'do'} not fit on "
            f"{quantity(dp * tp, 'GPU')} (tp={tp}, {_gb(usable)} usable each) even with ZeRO-3{ac}")
    if not offload_allowed:
        return PlanError(f"{what}, and offload is off (parallel.offload: false): use at least {zero3}, GPUs with "
                         "more memory, or allow offload (auto).")
    offload_dp = _min_dp(p_bytes + g_bytes, params, tp, room)  # the optimizer states on the host
    if host_usable is not None:  # and a node's ranks' host shares within its host memory
        host_per_param = host_bytes_per_param(precision, reduce_dtype)
        offload_dp = max(offload_dp, _min_dp(host_per_param * ranks_per_node, params, tp, host_usable))
    offloaded = needed(offload_dp)
    if offloaded.startswith("more than"):
        use = f"use {offloaded}"
    else:
        without = zero3 if zero3.startswith("more than") else f"at least {zero3}"
        use = f"use at least {offloaded} with the optimizer offloaded or {without} without"
    return PlanError(f"{what} and CPU offload: {use}, or GPUs with more memory.")


def _host_error(params, dp, tp, option: Option, ranks_per_node: int, node_size_known: bool,
                host_usable: Fraction, plain_dp: Optional[int], nvme_hint: bool = False,
                host_at: Optional[callable] = None) -> PlanError:
    """The offloaded states do not fit the host: name the smallest count of GPUs that would do, with offload
    (more DP ranks, smaller host shares) or, when offload is on auto (``plain_dp``), plain ZeRO-3 on more GPUs.
    ``host_at(dp)``: a rank's host bytes at another DP degree where they do not shrink as 1/dp (NVMe offload's
    swap buffers); ``nvme_hint``: NVMe offload was not weighed (no disk declared), so the sentence names it."""
    need = Fraction(option.host_bytes) * ranks_per_node
    if host_at is None:
        host_dp = max(dp, math.ceil(Fraction(option.host_bytes) * dp * ranks_per_node / host_usable))  # host ∝ 1/dp
    else:
        host_dp = _min_dp_where(lambda d: Fraction(host_at(d)) * ranks_per_node <= host_usable, dp)
    step = math.lcm(tp, ranks_per_node)
    if plain_dp is not None and -(-plain_dp * tp // step) <= -(-host_dp * tp // step):
        use, why = plain_dp, ", where ZeRO-3 fits without offload"
    else:
        use, why = host_dp, ", as more DP ranks shard the states further"
    gpus = _gpus_needed(use * tp, tp, ranks_per_node, node_size_known)
    ranks = (f"a node's {quantity(ranks_per_node, 'rank')} need {_gb(option.host_bytes)} each = {_gb(need)}"
             if ranks_per_node > 1 else f"a node's one rank needs {_gb(need)}")
    where = "NVMe" if option.nvme else "CPU"
    held = " (their gradient shards and swap buffers)" if option.nvme else ""
    also = ", or an NVMe disk for the optimizer states (cluster.nvme_path)" if nvme_hint else \
        ", or a smaller zero.sub_group_size (the swap buffers hold three of its records)" if option.nvme else ""
    return PlanError(
        f"{quantity(params, 'parameter')} fit on the GPUs only with the optimizer states offloaded to {where} (ZeRO-"
        f"{option.label}), but {ranks} of host memory{held} and a node has {_gb(host_usable)} usable: use "
        f"{'' if gpus.startswith('more than') else 'at least '}{gpus}{why}, or nodes with more host memory "
        f"(cluster.host_memory_gb){also}."
    )


def _disk_error(params, dp, tp, option: Option, ranks_per_node: int, node_size_known: bool,
                disk_usable: Fraction) -> PlanError:
    """The swap files do not fit the disk: the smallest GPU count at which a node's share does (disk ∝ 1/dp)."""
    need = Fraction(option.disk_bytes) * ranks_per_node
    disk_dp = max(dp, math.ceil(Fraction(option.disk_bytes) * dp * ranks_per_node / disk_usable))
    gpus = _gpus_needed(disk_dp * tp, tp, ranks_per_node, node_size_known)
    ranks = (f"a node's {quantity(ranks_per_node, 'rank')} need {_gb(option.disk_bytes)} each = {_gb(need)}"
             if ranks_per_node > 1 else f"a node's one rank needs {_gb(need)}")
    return PlanError(
        f"{quantity(params, 'parameter')} fit on the GPUs and in host memory only with the optimizer states "
        f"offloaded to NVMe (ZeRO-{option.label}), but {ranks} of disk and a node has {_gb(disk_usable)} usable "
        f"there: use {'' if gpus.startswith('more than') else 'at least '}{gpus}, as more DP ranks shard the "
        "states further, or a larger disk (cluster.nvme_path, cluster.nvme_gb)."
    )


def _min_dp_where(ok, start: int) -> int:
    """The smallest DP degree from ``start`` for which ``ok(dp)`` holds (``ok`` monotone), or one past
    ``MAX_GPUS`` when none up to it does."""
    if ok(start):
        return start
    lo, hi = start, start * 2
    while not ok(hi):
        if hi > MAX_GPUS:
            return MAX_GPUS + 1
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if ok(mid) else (mid, hi)
    return hi


def choose_stage(
    params: int,
    dp: int,
    tp: int,
    gpu_memory_bytes: float,
    precision: str = DEFAULT_PRECISION,
    activation_bytes: float = 0.0,
    headroom: float = 0.1,
    forced_stage: int | None = None,
    *,
    checkpointed_activation_bytes: float | None = None,
    offload: bool | str | None = None,
    activation_checkpointing: bool | None = None,
    host_memory_bytes: float | None = None,
    ranks_per_node: int = 1,
    node_size_known: bool = True,
    reduce_dtype: str | None = None,
    nvme: bool = False,
    nvme_bytes: float | None = None,
    sub_group_size: int = DEFAULT_SUB_GROUP_SIZE,
    shard: int | None = None,
    secondary: int = 1,
) -> Plan:
    """Pick the ZeRO stage and levers for Ψ=``params`` on a dp × tp mesh; see the module docstring.
    ``reduce_dtype``: the gradients' dtype (``zero.reduce_dtype``), default the model's ``precision``.
    ``nvme``: NVMe offload is an option under ``offload`` auto (a disk is declared; ``offload="nvme"`` forces
    it); ``nvme_bytes``: a node's disk space for the swap files (None: unknown, not checked);
    ``sub_group_size``: ``zero.sub_group_size``, the swap store's records (its host buffers). ``shard``,
    ``secondary``: the states sharded over ``shard`` of the dp ranks (``zero.shard_group``), hpZ's secondary
    shard over ``secondary`` ranks (the time model's choice of link options)."""
    _validate(dp, tp, gpu_memory_bytes, activation_bytes, headroom, forced_stage, checkpointed_activation_bytes,
              offload, activation_checkpointing, host_memory_bytes, ranks_per_node, node_size_known, nvme_bytes,
              sub_group_size)
    offload = check_offload("offload", offload)
    ac = check_lever("activation_checkpointing", activation_checkpointing)
    v.boolean("nvme", nvme)
    stages = all_stages(params, dp, tp, precision, reduce_dtype, shard=shard, secondary=secondary)
    group = shard or dp  # the DP ranks the states are split over
    usable = _usable(gpu_memory_bytes, headroom)
    host_usable = None if host_memory_bytes is None else _usable(host_memory_bytes, headroom)
    disk_usable = None if nvme_bytes is None else _usable(nvme_bytes, headroom)
    acts = {False: Fraction(activation_bytes), True: Fraction(activation_bytes)}
    if checkpointed_activation_bytes is not None:
        acts[True] = min(acts[False], Fraction(checkpointed_activation_bytes))
    ac_lever = ac is None and acts[True] < acts[False]  # the planner may turn it on
    base_ac = bool(ac)
    cpu_offload = offload is None or offload is True  # CPU offload is weighed
    nvme_offload = offload == OFFLOAD_NVME or (offload is None and nvme)  # NVMe offload is weighed

    def option(stage: int, with_ac: bool, off) -> Option:
        disk, disk_fits = Fraction(0), None
        if off == OFFLOAD_NVME:
            split = nvme_offload_bytes(params, group, stage, tp, precision, reduce_dtype, sub_group_size)
            device, host, disk = Fraction(split.device) + acts[with_ac], Fraction(split.host), Fraction(split.disk)
            host_fits = None if host_usable is None else host * ranks_per_node <= host_usable
            disk_fits = None if disk_usable is None else disk * ranks_per_node <= disk_usable
        elif off:
            split = offload_bytes(params, group, stage, tp, precision, reduce_dtype)
            device, host = Fraction(split.device) + acts[with_ac], Fraction(split.host)
            host_fits = None if host_usable is None else host * ranks_per_node <= host_usable
        else:
            device, host, host_fits = Fraction(stages[stage].total) + acts[with_ac], Fraction(0), None
        fits = device <= usable and host_fits is not False and disk_fits is not False
        return Option(stage, with_ac, bool(off), float(device), float(host), fits, host_fits,
                      off == OFFLOAD_NVME, float(disk), disk_fits)

    tried: list[Option] = []

    def plan(o: Option, reason: str) -> Plan:
        return Plan(o.stage, o.offload, reason, stages, fits, dp, tp, gpu_memory_bytes, activation_bytes, headroom,
                    o.activation_checkpointing, checkpointed_activation_bytes, o.host_bytes, host_memory_bytes,
                    ranks_per_node, tuple(tried), nvme=o.nvme, disk_bytes=o.disk_bytes, nvme_bytes=nvme_bytes)

    def attempt(stage: int, with_ac: bool, off) -> Option:
        o = option(stage, with_ac, off)
        tried.append(o)
        return o

    fits = {s: option(s, base_ac, False).fits for s in STAGES}
    budget = f"{_gb(usable)} usable per GPU"
    ac_text = " with activation checkpointing" if base_ac else ""
    where = _Where(budget, ranks_per_node, host_usable, disk_usable, base_ac)

    if forced_stage is not None:
        return _forced(forced_stage, offload, ac_lever, base_ac, attempt, plan, where, nvme_offload)

    if offload is None or offload is False:
        first = [attempt(s, base_ac, False) for s in STAGES]
        if first[0].fits and dp == 1:
            return plan(first[0], f"{ROW_STANDARD_DP}{ac_text} and DP degree is 1, nothing to shard: needs "
                                  f"{_gb(first[0].device_bytes)} of {budget}")
        if first[0].fits:
            return plan(first[1], f"{ROW_STANDARD_DP}{ac_text}: stage 1 has the same traffic as DP and less memory "
                                  f"({_gb(first[1].device_bytes)} instead of {_gb(first[0].device_bytes)} of "
                                  f"{budget})")
        for s in STAGES[1:]:  # the lowest that fits, each said beside the one below it
            if first[s].fits:
                return plan(first[s], f"{_ROW_FOR_STAGE[s]}{ac_text}: stage {s - 1} needs "
                                      f"{_gb(first[s - 1].device_bytes)}, stage {s} "
                                      f"{_gb(first[s].device_bytes)} of {budget}")
        if ac_lever:
            with_ac = attempt(3, True, False)
            if with_ac.fits:
                return plan(with_ac, f"{ROW_AC}: stage 3 needs {_gb(first[3].device_bytes)}, "
                                     f"{_gb(with_ac.device_bytes)} with activation checkpointing, of {budget}")
    offloaded: list = []
    if cpu_offload:
        offloaded = [attempt(s, base_ac, True) for s in (OFFLOAD_STAGES if offload else STAGES[-1:])]
        if ac_lever:
            offloaded.append(attempt(3, True, True))
        for o in offloaded:
            if o.fits:
                return plan(o, _offload_reason(o, option(o.stage, base_ac, False), bool(offload), base_ac, budget,
                                               ranks_per_node, host_usable))
    on_nvme: list = []
    if nvme_offload:  # the guide's next row: the states on the node's disk, the host keeping the gradient copy
        on_nvme = [attempt(s, base_ac, OFFLOAD_NVME) for s in (OFFLOAD_STAGES if offload else STAGES[-1:])]
        if ac_lever:
            on_nvme.append(attempt(3, True, OFFLOAD_NVME))
        for o in on_nvme:
            if o.fits:
                cpu = next((c for c in offloaded if (c.stage, c.activation_checkpointing) ==
                            (o.stage, o.activation_checkpointing)), None)
                return plan(o, _nvme_reason(o, option(o.stage, base_ac, False), cpu, offload == OFFLOAD_NVME, where))
    smallest = acts[True] if (ac_lever or base_ac) else acts[False]  # activations of the last resort
    if offload is not False:
        plain_dp = (_min_dp(sum(bytes_per_param(precision, reduce_dtype)), params, tp, usable - smallest)
                    if offload is None and usable > smallest else None)
        disk_short = [o for o in on_nvme if Fraction(o.device_bytes) <= usable and o.host_fits is not False]
        if disk_short:  # the GPUs and the host would do; the disk is what is too small
            raise _disk_error(params, dp, tp, disk_short[0], ranks_per_node, node_size_known, disk_usable)
        on_gpu = [o for o in offloaded if Fraction(o.device_bytes) <= usable]
        if on_gpu:  # the GPUs would do; the host memory is what is too small
            raise _host_error(params, dp, tp, on_gpu[0], ranks_per_node, node_size_known, host_usable, plain_dp,
                              nvme_hint=offload is None and not nvme)
        on_gpu = [o for o in on_nvme if Fraction(o.device_bytes) <= usable]
        if on_gpu:  # NVMe alone was weighed, and even its host share is too large
            o = on_gpu[0]
            raise _host_error(params, dp, tp, o, ranks_per_node, node_size_known, host_usable, plain_dp,
                              host_at=lambda d: nvme_offload_bytes(params, d, o.stage, tp, precision, reduce_dtype,
                                                                   sub_group_size).host)
    raise _no_fit_error(params, dp, tp, precision, usable, smallest, offload is not False, ac_lever or base_ac,
                        ranks_per_node, node_size_known, host_usable, reduce_dtype)


@dataclass(frozen=True)
class _Where:
    """What the reasons say the bytes are measured against."""

    budget: str  # "<usable> usable per GPU"
    ranks_per_node: int
    host_usable: Optional[Fraction]
    disk_usable: Optional[Fraction]
    base_ac: bool


def _offload_reason(o: Option, plain: Option, forced: bool, base_ac: bool, budget: str, ranks_per_node: int,
                    host_usable: Optional[Fraction]) -> str:
    if forced:
        row = f"stage {o.stage} with CPU offload of optimizer states as requested (parallel.offload: true)"
    else:
        row = ROW_OFFLOAD_AC if o.activation_checkpointing and not base_ac else ROW_OFFLOAD
    how = " and activation checkpointing" if o.activation_checkpointing and not base_ac else ""
    return (f"{row}: stage {o.stage} needs {_gb(plain.device_bytes)}, {_gb(o.device_bytes)} with the optimizer on "
            f"CPU{how}, of {budget}; {_host_text(o, ranks_per_node, host_usable)}")


def _nvme_reason(o: Option, plain: Option, cpu: Optional[Option], forced: bool, where: _Where) -> str:
    """The NVMe row's reason: the GPU's bytes, why not CPU offload (the host), then the host's and the disk's."""
    with_ac = o.activation_checkpointing and not where.base_ac
    if forced:
        row = f"stage {o.stage} with the optimizer states offloaded to NVMe as requested (parallel.offload: nvme)"
    else:
        row = ROW_NVME_AC if with_ac else ROW_NVME
    how = " and activation checkpointing" if with_ac else ""
    text = (f"{row}: stage {o.stage} needs {_gb(plain.device_bytes)}, {_gb(o.device_bytes)} with the optimizer off "
            f"the GPU{how}, of {where.budget}; ")
    if cpu is not None and cpu.host_fits is False:
        text += (f"CPU offload needs {_gb(Fraction(cpu.host_bytes) * where.ranks_per_node)} of host memory per node, "
                 f"{_gb(where.host_usable)} usable; ")
    return text + f"{_host_text(o, where.ranks_per_node, where.host_usable)}; " + \
        _disk_text(o, where.ranks_per_node, where.disk_usable)


def _host_text(o: Option, ranks_per_node: int, host_usable: Optional[Fraction]) -> str:
    need = Fraction(o.host_bytes) * ranks_per_node
    what = "the gradient shards and swap buffers" if o.nvme else "the optimizer states and gradients"
    if host_usable is None:
        return (f"host memory not checked (unknown): {what} need {_gb(o.host_bytes)} per rank x "
                f"{ranks_per_node} = {_gb(need)} per node")
    return (f"host: {_gb(o.host_bytes)} per rank x {ranks_per_node} = {_gb(need)} of {_gb(host_usable)} usable "
            f"per node")


def _disk_text(o: Option, ranks_per_node: int, disk_usable: Optional[Fraction]) -> str:
    need = Fraction(o.disk_bytes) * ranks_per_node
    if disk_usable is None:
        return (f"disk not checked (unknown): the swap files need {_gb(o.disk_bytes)} per rank x {ranks_per_node} = "
                f"{_gb(need)} per node")
    return (f"disk: {_gb(o.disk_bytes)} per rank x {ranks_per_node} = {_gb(need)} of {_gb(disk_usable)} usable per "
            "node")


def _forced(stage, offload, ac_lever, base_ac, attempt, plan, where: _Where, nvme_offload: bool) -> Plan:
    """The plan at the requested stage: plain if it fits, else with the levers left on auto, in cost order."""
    candidates = []
    if offload is None or offload is False:
        candidates.append((stage, base_ac, False))
        if ac_lever:
            candidates.append((stage, True, False))
    sharded = policy_for(stage).shard_optimizer
    if (offload is None or offload is True) and sharded:
        candidates.append((stage, base_ac, True))
        if ac_lever:
            candidates.append((stage, True, True))
    if nvme_offload and sharded:
        candidates.append((stage, base_ac, OFFLOAD_NVME))
        if ac_lever:
            candidates.append((stage, True, OFFLOAD_NVME))
    tried = [attempt(*c) for c in candidates]
    chosen = next((o for o in tried if o.fits), None)
    verdict = ""
    if chosen is None:
        chosen, verdict = tried[0], ", but it does not fit"
    where_to = "NVMe" if chosen.nvme else "CPU"
    extras = [text for on, text in ((chosen.activation_checkpointing, "activation checkpointing"),
                                    (chosen.offload, f"the optimizer offloaded to {where_to}")) if on]
    with_ = f" with {' and '.join(extras)}" if extras else ""
    reason = f"stage {stage} as requested{with_}{verdict}: needs {_gb(chosen.device_bytes)} of {where.budget}"
    if chosen.offload:
        reason += f"; {_host_text(chosen, where.ranks_per_node, where.host_usable)}"
    if chosen.nvme:
        reason += f"; {_disk_text(chosen, where.ranks_per_node, where.disk_usable)}"
    return plan(chosen, reason)


def layout_option(params: int, dp: int, tp: int, stage: int, gpu_memory_bytes: float,
                  precision: str = DEFAULT_PRECISION, activation_bytes: float = 0.0, headroom: float = 0.1, *,
                  activation_checkpointing: bool = False, offload: bool = False,
                  host_memory_bytes: float | None = None, ranks_per_node: int = 1,
                  extra_bytes: float = 0.0, nvme: bool = False, nvme_bytes: float | None = None,
                  sub_group_size: int = DEFAULT_SUB_GROUP_SIZE, shard: int | None = None,
                  secondary: int = 1) -> Option:
    """One option with its bytes and whether it fits, by ``choose_stage``'s rule (model states on the GPU plus
    ``activation_bytes``, the estimate of this option's micro-batch and checkpointing, plus ``extra_bytes``
    a run measured beyond its prediction, within ``gpu_memory_bytes · (1 − headroom)``; with offload, a
    node's host shares within its host memory when known; with ``nvme`` (offload to NVMe), also a node's swap
    files within ``nvme_bytes`` when known), sharded over ``shard`` of the ``dp`` ranks (default all;
    ``zero.shard_group``) with hpZ's secondary shard over ``secondary``. The time-aware search
    (``hybrid.plan.candidates``) asks it for every layout it ranks."""
    from hybrid.plan.memory import model_state_bytes

    usable = _usable(gpu_memory_bytes, headroom)
    acts = Fraction(activation_bytes) + Fraction(extra_bytes)
    disk, disk_fits = Fraction(0), None
    group = shard or dp  # the DP ranks the states are split over
    if offload and nvme:
        split = nvme_offload_bytes(params, group, stage, tp, precision, sub_group_size=sub_group_size)
        disk = Fraction(split.disk)
        disk_fits = None if nvme_bytes is None else disk * ranks_per_node <= _usable(nvme_bytes, headroom)
    elif offload:
        split = offload_bytes(params, group, stage, tp, precision)
    if offload:
        device, host = Fraction(split.device) + acts, Fraction(split.host)
        if secondary > 1 and policy_for(stage).shard_params:
            device += Fraction(model_state_bytes(params, dp, stage, tp, precision, shard=shard, secondary=secondary)
                               .params) - Fraction(model_state_bytes(params, dp, stage, tp, precision,
                                                                     shard=shard).params)
        host_fits = None if host_memory_bytes is None else \
            host * ranks_per_node <= _usable(host_memory_bytes, headroom)
    else:
        device = Fraction(model_state_bytes(params, dp, stage, tp, precision, shard=shard,
                                            secondary=secondary).total) + acts
        host, host_fits = Fraction(0), None
    return Option(stage, activation_checkpointing, offload, float(device), float(host),
                  device <= usable and host_fits is not False and disk_fits is not False, host_fits,
                  bool(offload and nvme), float(disk), disk_fits)
