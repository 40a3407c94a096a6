"""Typed training configuration for the ZeRO engine, built from our dict or a DeepSpeed-style dict.

``TrainConfig(zero=ZeroConfig(...), precision="bf16"|"fp32", optimizer=OptimizerConfig(...),
scheduler=None|SchedulerConfig(...), gradient_clipping=None|float, gradient_accumulation_steps=None|int,
max_nonfinite_skips=5)``; accumulation left out is 1, or with both batch sizes given derived by
``check_batch(dp)`` as DeepSpeed does (train_batch_size / (micro batch x dp)). Each section is one schema
(``hybrid.config.schema``): its fields carry their default, their check, their DeepSpeed spelling and aliases,
so the readers, the defaults and the checks are written once. Every field is checked on construction, once,
under the path the user wrote (``zero_optimization.stage`` for the DeepSpeed spelling, ``zero.stage`` in ours,
``train.optimizer.lr`` under a model config's ``train:``); a bad value raises ``ConfigError`` naming the field
and the fix.

``TrainConfig.from_dict(d)`` accepts both spellings, mixed freely:

* ours: ``{"zero": {...}, "precision": "bf16", "optimizer": {"lr": ..., "betas": ..., ...}, ...}``
* DeepSpeed: ``{"zero_optimization": {...}, "bf16": {"enabled": true}, "optimizer": {"type": "AdamW",
  "params": {...}}, "gradient_clipping": 1.0, "gradient_accumulation_steps": 2,
  "train_micro_batch_size_per_gpu": 4, "train_batch_size": 32, "scheduler": {"type": "WarmupCosineLR",
  "params": {...}}}``; ``stage3_prefetch_bucket_size`` and ``stage3_param_persistence_threshold`` are
  aliases of the plain names. ``fp16`` is refused (use bf16). DeepSpeed settings without a field here are in
  ``DEEPSPEED_KNOBS``: ignored (one log line) where they cannot change the training, else refused with the
  reason. A DeepSpeed-form optimizer (``params``) without ``weight_decay`` decays nothing, as DeepSpeed's
  optimizers do (``DEEPSPEED_WEIGHT_DECAY``), and decays every parameter unless its ``no_decay`` says
  otherwise (``DEEPSPEED_NO_DECAY``: ``none``; ours defaults to ``auto``).
  ``stage3_unit`` (``auto`` | ``module`` | a callable ``(name, module) -> bool``) cuts stage 3's units
  (``hybrid.zero.units``). ``reduce_dtype`` (``fp32`` | ``bf16``; default the model's precision, the
  seed's bf16 gradients) is the dtype a bf16 model's gradients are summed over DP and accumulated over
  micro-steps in: ``fp32`` keeps them in fp32 buffers (2 more bytes per gradient element held, twice the
  gradient traffic, no fp32 copy at the optimizer step).

The optimizer is any elementwise ``torch.optim`` class by name (``AdamW`` default, ``Adam``, ``SGD``,
``RMSprop``, ...); its keyword arguments go in ``optimizer.params`` (or beside ``type``) and are checked
against the class. Beside them (ours): ``no_decay`` (``auto``: no weight decay on 1-D parameters --
biases, norms -- and embedding weights; ``none``; or a list of name patterns), ``param_groups`` (a list
of ``{names: [patterns], weight_decay: x, lr_scale: y}``, first match wins) and ``implementation``
(``auto`` | ``fused`` | ``foreach`` | ``for-loop``). ``zero_optimization.offload_optimizer: {device: cpu,
pin_memory: true}`` keeps the fp32 master and the optimizer state in host memory (stages 1-3);
``{device: nvme, path: /local/nvme}`` (DeepSpeed's ``nvme_path``; an absolute path) keeps them in a swap file
per rank on that local disk (ZeRO-Infinity's optimizer offload; ``hybrid.zero.nvme``), the gradient shard the
optimizer steps from in host memory. DeepSpeed's ``nvme_path`` beside another device is not read, as there.
Either way the host step runs with ``threads`` threads (default: the node's cores divided among its ranks).

Unknown keys are an error that names every unknown key of the section (whole) and lists the accepted ones. Sizes are in
elements, as in DeepSpeed, and may be written as floats (``5e8``) when they are whole numbers.
Defaults follow the seed (bucket sizes 5e8, prefetch 5e7, persistence 1e5, sub-group 1e9) and
``torch.optim.AdamW`` (lr 1e-3, betas (0.9, 0.999), eps 1e-8; weight decay: the named class's default, 0.01
for AdamW, in our form).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any, Optional

from hybrid.config import validate as v
from hybrid.config.deepspeed import DEEPSPEED_KNOBS, drop_deepspeed_knobs
from hybrid.config.optimizers import (NOT_ELEMENTWISE, default_weight_decay, optimizer_kwargs_allowed,
                                      torch_optimizer_class)
from hybrid.config.schema import (Section, Where, deepspeed_defaults, default_of, path_value, section_check, setting,
                                  setting_of, spelled)
from hybrid.config.validate import PRECISIONS
from hybrid.errors import ConfigError

__all__ = ["DEEPSPEED_KNOBS", "DEEPSPEED_NO_DECAY", "DEEPSPEED_WEIGHT_DECAY", "NOT_ELEMENTWISE", "OffloadConfig",
           "OptimizerConfig", "SchedulerConfig", "TrainConfig", "ZeroConfig", "default_weight_decay",
           "optimizer_kwargs_allowed", "read_optimizer", "torch_optimizer_class"]

log = logging.getLogger(__name__)


def _size(minimum: int):
    """Sizes and counts: whole numbers, also written as whole floats (``5e8``) as in DeepSpeed."""
    return partial(v.integer, lo=minimum, whole_floats=True)


_NON_NEGATIVE = partial(v.number, lo=0.0)


# -- zero.offload_optimizer --------------------------------------------------------------------------------
OFFLOAD_DEVICES = ("none", "cpu", "nvme")


def _offload_device(path: str, value: Any) -> str:
    return v.one_of(path, "none" if value is None else value, OFFLOAD_DEVICES)


def _nvme_path(path: str, value: Any) -> Path:
    directory = path_value(path, value)
    if not directory.is_absolute():
        raise ConfigError(f"{path} is {v.quote(str(value))}, a relative path; give the absolute path of a directory "
                          f"on the node's local NVMe disk (each rank keeps its swap file there).")
    return directory


@dataclass(frozen=True)
class OffloadConfig(Section):
    """Where the fp32 master weights and optimizer state live: ``none`` (the device), ``cpu`` (host memory,
    pinned when ``pin_memory`` and the device is CUDA) or ``nvme`` (a swap file per rank under ``path``, a
    directory on the node's local disk, read and written an optimizer batch at a time: ``hybrid.zero.nvme``);
    ``threads``: the host step's threads with ``cpu`` or ``nvme`` (unset: the rank's share of its node's cores,
    ``hybrid.zero.host_threads``)."""

    SECTION = "zero.offload_optimizer"
    SORTED_KEYS = True

    device: str = setting("none", _offload_device, help="none (the device), cpu (host memory) or nvme (a local "
                                                        "disk, under path)")
    pin_memory: bool = setting(False, v.boolean, help="pinned host buffers (with CUDA)")
    threads: Optional[int] = setting(None, _size(1), help="threads of the host optimizer step; unset: the node's "
                                     "cores / its ranks")
    path: Optional[Path] = setting(None, _nvme_path, deepspeed="nvme_path",
                                   help="device nvme: a directory on the node's local NVMe disk")

    def _check_together(self, where: Where) -> None:
        device, path = where("device"), where("path")
        if self.device == "nvme" and self.path is None:
            raise ConfigError(f"{device} is nvme but {path} is not set; set it to a directory on the node's local "
                              f"NVMe disk (each rank keeps its swap file there).")
        if self.device != "nvme" and self.path is not None:
            if path.endswith("nvme_path"):  # DeepSpeed's form: read only with device nvme, as DeepSpeed does
                self._set("path", None)
                return
            raise ConfigError(f"{path} is set but {device} is {self.device}; set {device} to nvme to keep the "
                              f"optimizer states on that disk, or remove {path}.")

    @property
    def enabled(self) -> bool:
        return self.device != "none"

    @property
    def nvme(self) -> bool:
        return self.device == "nvme"


# -- zero / zero_optimization ------------------------------------------------------------------------------
STAGE3_UNITS = ("auto", "module")  # hybrid.zero.units: which modules are stage-3 unit roots
QUANTIZED = ("none", "int8")  # zero.quantized_weights / quantized_gradients


def _shard_group(path: str, value: Any) -> Any:
    """``all`` | ``node`` | a number of ranks (DeepSpeed's ``mics_shard_size``: -1 is MiCS off, i.e. all)."""
    if isinstance(value, str) and value in ("all", "node"):
        return value
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value == -1:
        return "all"
    return v.integer(path, value, 1, whole_floats=True, need="all, node or a number of DP ranks dividing the DP size")


def _secondary_shard(path: str, value: Any) -> Any:
    """``none`` | ``node`` | a number of ranks of one node (DeepSpeed's ``zero_hpz_partition_size``; 1 is none)."""
    if value is None or isinstance(value, str) and value in ("none", "node"):
        return value or "none"
    n = v.integer(path, value, 1, whole_floats=True, need="none, node or a number of DP ranks of one node")
    return "none" if n == 1 else n


def _quantized(path: str, value: Any) -> str:
    """``none`` | ``int8``; DeepSpeed's switches (``zero_quantized_weights: true``) are int8 and none."""
    if isinstance(value, bool):
        return "int8" if value else "none"
    return v.one_of(path, "none" if value is None else value, QUANTIZED)


def _stage3_unit(path: str, unit: Any) -> Any:
    if not callable(unit) and not (isinstance(unit, str) and unit in STAGE3_UNITS):
        raise ConfigError(f"{path} must be auto, module or a function (module_name, module) -> bool marking the "
                          f"unit roots, got {unit!r}; use auto (one unit per block) unless you need another cut.")
    return unit


@dataclass(frozen=True)
class ZeroConfig(Section):
    """ZeRO policy on the data-parallel group. Sizes count elements, not bytes."""

    SECTION = "zero"
    SORTED_KEYS = True

    stage: int = setting(0, partial(v.stage, whole_floats=True), help="0, 1, 2 or 3")
    reduce_bucket_size: int = setting(500_000_000, _size(1),
                                      help="stages 0-2: elements per gradient bucket (one collective each)")
    allgather_bucket_size: int = setting(500_000_000, _size(1),
                                         help="stages 1-2: elements in flight in the post-step all-gather")
    prefetch_bucket_size: int = setting(50_000_000, _size(1), aliases=("stage3_prefetch_bucket_size",),
                                        help="stage 3: elements gathered ahead of the running module")
    param_persistence_threshold: int = setting(100_000, _size(0), aliases=("stage3_param_persistence_threshold",),
                                               help="stage 3: parameters with fewer elements stay gathered")
    sub_group_size: int = setting(1_000_000_000, _size(1),
                                  help="the optimizer steps the shard in pieces of this many elements")
    overlap_comm: bool = setting(True, v.boolean, help="keep gradient collectives in flight during backward")
    reduce_scatter: bool = setting(True, v.boolean, help="stages 1-3: reduce-scatter (else all-reduce) gradients")
    contiguous_gradients: bool = setting(True, v.boolean,
                                         help="accepted for DeepSpeed configs; gradients are always flat")
    offload_optimizer: OffloadConfig = setting(factory=OffloadConfig, check=section_check(OffloadConfig),
                                               help="stages 1-3: {device: cpu} keeps the optimizer in host memory, "
                                                    "{device: nvme, path: DIR} on a local disk")
    stage3_unit: Any = setting("auto", _stage3_unit, help="stage 3: auto | module | callable(name, module) -> bool")
    reduce_dtype: Optional[str] = setting(None, partial(v.one_of, choices=PRECISIONS),
                                          help="gradients summed and accumulated in: fp32 | bf16; unset: the model's")
    shard_group: Any = setting("all", _shard_group, deepspeed="mics_shard_size",
                               help="stages 1-3: shard over all DP ranks, the ranks of a node, or N ranks; "
                                    "replicated across such groups (MiCS / HSDP)")
    hierarchical: bool = setting(False, v.boolean,
                                 help="stages 1-3: reduce-scatter and all-gather inside the node, then across nodes")
    secondary_shard: Any = setting("none", _secondary_shard, deepspeed="zero_hpz_partition_size",
                                   help="stage 3: none, or a secondary parameter shard over the node's ranks (node) "
                                        "or N of them, for backward's all-gather (ZeRO++ hpZ)")
    quantized_weights: str = setting("none", _quantized, deepspeed="zero_quantized_weights",
                                     help="stage 3: none | int8 parameter all-gathers (ZeRO++ qwZ)")
    quantized_gradients: str = setting("none", _quantized, deepspeed="zero_quantized_gradients",
                                       help="stages 1-3: none | int8 gradient reduce-scatter (ZeRO++ qgZ)")
    quantization_block: int = setting(256, _size(1), help="elements per scale of the int8 collectives")

    def _check_together(self, where: Where) -> None:
        from hybrid.config.stage_policy import policy_for  # pure table; imported here to keep config import-light

        policy, stage = policy_for(self.stage), where("stage")
        if self.offload_optimizer.enabled and not policy.shard_optimizer:
            offload = where("offload_optimizer")
            raise ConfigError(f"{offload} needs ZeRO stage 1, 2 or 3, but {stage} is {self.stage}: stage 0 keeps a "
                              f"full optimizer copy on every rank, so offloading it would move N times the bytes; "
                              f"set {stage} to 1 or more, or offload_optimizer.device: none.")
        if not policy.shard_optimizer:
            for name, off in (("shard_group", "all"), ("hierarchical", False)):
                if getattr(self, name) != off:
                    raise ConfigError(f"{where(name)} changes how the sharded states are reduced and gathered, but "
                                      f"{stage} is {self.stage}, which shards nothing; set {stage} to 1 or more, or "
                                      f"remove {where(name)}.")
        if not policy.shard_params:
            for name, off, what in (("quantized_weights", "none", "quantizes the parameter all-gathers of each unit"),
                                    ("secondary_shard", "none", "keeps a secondary shard of the gathered parameters")):
                if getattr(self, name) != off:
                    raise ConfigError(f"{where(name)} {what}, which only ZeRO stage 3 does (it shards the "
                                      f"parameters), but {stage} is {self.stage}; set {stage} to 3, or remove "
                                      f"{where(name)}.")
        if self.quantized_gradients != "none" and (policy.grads_all_reduced or not self.reduce_scatter):
            path = where("quantized_gradients")
            raise ConfigError(f"{path} quantizes the gradients' reduce-scatter, but "
                              + (f"{stage} is {self.stage}, which all-reduces them; set {stage} to 1 or more"
                                 if policy.grads_all_reduced else
                                 f"{where('reduce_scatter')} is false (they are all-reduced); set it to true")
                              + f", or remove {path}.")


# -- optimizer ---------------------------------------------------------------------------------------------
IMPLEMENTATIONS = ("auto", "fused", "foreach", "for-loop")
# DeepSpeed's optimizers (FusedAdam, DeepSpeedCPUAdam, FusedLamb, ...) decay nothing unless told: a DeepSpeed-style
# optimizer section ({"type": ..., "params": {...}}) without weight_decay gets this, whatever torch's default.
DEEPSPEED_WEIGHT_DECAY = 0.0
# ... and decay every parameter they are given: in that form no parameter is exempted unless no_decay says so
# (ours exempts biases, norms and embeddings: no_decay "auto").
DEEPSPEED_NO_DECAY = "none"
_PLAIN = ("lr", "betas", "eps", "weight_decay")  # torch keyword arguments with a field of their own
_BESIDE_PARAMS = ("type", "no_decay", "param_groups", "implementation")  # beside DeepSpeed's params, not in it


def _betas(path: str, betas: Any) -> tuple:
    if not isinstance(betas, (list, tuple)) or len(betas) != 2:
        raise v.invalid(path, "a pair [beta1, beta2]", betas)
    b1, b2 = (v.number(path, b, lo=0.0) for b in betas)
    if not (b1 < 1.0 and b2 < 1.0):
        raise v.invalid(path, "two numbers in [0, 1)", list(betas))
    return b1, b2


def _pairs(path: str, value: Any) -> dict:
    """Keyword arguments held as ``(name, value)`` pairs (as constructed) or a mapping (as written)."""
    if isinstance(value, tuple) and all(isinstance(pair, tuple) and len(pair) == 2 for pair in value):
        return dict(value)
    return v.mapping(path, value)


def _list(path: str, value: Any) -> list:
    if isinstance(value, (list, tuple)):
        return list(value)
    raise v.invalid(path, "a list", value)


def _patterns(path: str, value: Any) -> tuple:
    items = [value] if isinstance(value, str) else _list(path, value)
    return tuple(v.text(path, item, "a list of parameter name patterns (strings)") for item in items)


def _no_decay(path: str, value: Any):
    if isinstance(value, str) and value in ("auto", "none"):
        return value
    if not isinstance(value, (str, list, tuple)):
        raise v.invalid(path, "'auto', 'none' or a list of parameter name patterns", value)
    return _patterns(path, value)


def _param_group(path: str, value: Any) -> dict:
    group = v.mapping(path, value, ("names", "weight_decay", "lr_scale"), example="{names: ['*.bias'], lr_scale: 2}")
    out = {"names": _patterns(f"{path}.names", v.required(group, path, "names", "a list of parameter name patterns"))}
    for key in ("weight_decay", "lr_scale"):
        if key in group:
            out[key] = _NON_NEGATIVE(f"{path}.{key}", group[key])
    return out


def _param_groups(path: str, value: Any) -> tuple:
    return tuple(_param_group(f"{path}[{n}]", group) for n, group in enumerate(_list(path, value)))


@dataclass(frozen=True)
class OptimizerConfig(Section):
    """AdamW (decoupled weight decay) by default; ``decoupled_weight_decay=False`` is Adam with L2.

    ``type`` names any elementwise ``torch.optim`` class; ``extra`` holds its other keyword arguments
    (``(("momentum", 0.9),)``). ``no_decay``: ``"auto"`` (1-D parameters and embedding weights get no weight
    decay), ``"none"`` or a tuple of name patterns (fnmatch). ``param_groups``: a tuple of
    ``{"names": (patterns...), "weight_decay": x, "lr_scale": y}`` (either key optional), first match wins.
    """

    SECTION = "optimizer"
    SORTED_KEYS = True

    lr: float = setting(1e-3, _NON_NEGATIVE, help="learning rate")
    betas: tuple = setting((0.9, 0.999), _betas, help="[beta1, beta2], each in [0, 1)")
    eps: float = setting(1e-8, partial(v.number, lo=0.0, lo_open=True), help="added to the denominator")
    weight_decay: Optional[float] = setting(None, _NON_NEGATIVE, deepspeed_default=DEEPSPEED_WEIGHT_DECAY,
                                            help="unset: the named torch class's default (AdamW 0.01, Adam and SGD 0)")
    decoupled_weight_decay: bool = setting(True, v.boolean, deepspeed="adam_w_mode",
                                           help="Adam family: AdamW (true) or Adam with L2 (false)")
    type: str = setting("AdamW", help="a torch.optim class by name (checked with decoupled_weight_decay)")
    extra: tuple = setting((), help="the class's other keyword arguments, as (name, value) pairs")
    no_decay: Any = setting("auto", _no_decay, deepspeed_default=DEEPSPEED_NO_DECAY,
                            help="auto (1-D parameters and embeddings), none, or a list of name patterns")
    param_groups: tuple = setting((), _param_groups,
                                  help="[{names: [patterns], weight_decay: x, lr_scale: y}], first match wins")
    implementation: str = setting("auto", partial(v.one_of, choices=IMPLEMENTATIONS),
                                  help="auto | fused | foreach | for-loop")

    def _check_together(self, where: Where) -> None:
        cls = torch_optimizer_class(self.type, self.decoupled_weight_decay, where("type"))
        if self.weight_decay is None:  # the class named (Adam: 0, even where it runs as AdamW), not the one run
            self._set("weight_decay", default_weight_decay(self.type, self.decoupled_weight_decay))
        self._set("type", cls.__name__)
        extra = _pairs(where.section, self.extra)
        allowed = optimizer_kwargs_allowed(cls)
        unknown = [key for key in extra if key not in allowed]
        if unknown:  # named with every key the section may hold (our flat form also holds type and params)
            listed = {*allowed, *_SWITCH}
            if not where.section.endswith(".params"):
                listed |= {"type", "params"}
            v.known_keys(where.section, extra, sorted(listed - set(unknown)))
        self._set("extra", tuple(sorted(extra.items())))

    @property
    def torch_class(self):
        return torch_optimizer_class(self.type, self.decoupled_weight_decay)

    def torch_kwargs(self) -> dict:
        """The keyword arguments for ``torch_class`` (learning rate and hyperparameters, no implementation)."""
        allowed = optimizer_kwargs_allowed(self.torch_class)
        out = {"lr": self.lr, "weight_decay": self.weight_decay}
        if "betas" in allowed:
            out["betas"] = self.betas
        if "eps" in allowed:
            out["eps"] = self.eps
        out.update(dict(self.extra))
        return {k: val for k, val in out.items() if k in allowed}


_SWITCH = ("decoupled_weight_decay", setting_of(OptimizerConfig, "decoupled_weight_decay").deepspeed)  # torch's, DS's


def read_optimizer(section: Any, name: str = "optimizer") -> OptimizerConfig:
    """The ``OptimizerConfig`` of an ``optimizer`` section at ``name``: ours (``{type, lr, ...}``) or DeepSpeed's
    (``{type, params: {...}}``, whose defaults are the fields' ``deepspeed_default``s)."""
    section = v.mapping(name, section)
    values = {key: section[key] for key in _BESIDE_PARAMS if key in section}
    if "params" in section:  # DeepSpeed: {"type": ..., "params": {...}}
        v.known_keys(name, section, sorted({"params", *_BESIDE_PARAMS}))
        inner, params = f"{name}.params", dict(v.mapping(f"{name}.params", section["params"]))
        for key, default in deepspeed_defaults(OptimizerConfig).items():
            if key not in params and key not in values:
                values[key] = default
    else:
        inner, params = name, {key: value for key, value in section.items() if key not in _BESIDE_PARAMS}
    where = Where(inner, {key: v.join(name, key) for key in _BESIDE_PARAMS})
    given = [key for key in _SWITCH if key in params]
    switch = [params.pop(key) for key in given]
    for key, value in zip(given, switch) if len(switch) == 2 else ():  # compared, so read as switches first
        v.boolean(v.join(inner, key), value)
    if len(switch) == 2 and switch[0] != switch[1]:
        raise ConfigError(f"{inner}.{_SWITCH[0]} and {inner}.{_SWITCH[1]} disagree (torch's and DeepSpeed's name "
                          f"for the same switch); keep one of them.")
    if switch:
        values["decoupled_weight_decay"] = switch[0]
        where = where.also(decoupled_weight_decay=v.join(inner, given[0]))
        written = values.get("type")  # the file contradicting itself; a type left out is the Adam family's
        if switch[0] is False and isinstance(written, str) and written.lower() == "adamw":
            raise ConfigError(f"{inner}.{given[0]} is false but {name}.type is AdamW; use type Adam for L2 decay")
    # which keys the class takes decides whether lr, betas, ... are its fields or unknown keys (named as such)
    kind = values.get("type", default_of(OptimizerConfig, "type"))
    cls = torch_optimizer_class(kind, values.get("decoupled_weight_decay", True) is not False, where("type"))
    taken = optimizer_kwargs_allowed(cls)
    for key in _PLAIN:
        if key in params and key in taken:
            values[key] = params.pop(key)
    values["extra"] = tuple(params.items())
    return OptimizerConfig(**values, where=where)


# -- scheduler ---------------------------------------------------------------------------------------------
def _schedule_type(path: str, value: Any) -> str:
    from hybrid.config.schedule import SCHEDULES

    return v.one_of(path, value, tuple(SCHEDULES))


@dataclass(frozen=True)
class SchedulerConfig(Section):
    """A DeepSpeed learning-rate schedule (``hybrid.config.schedule.SCHEDULES``): ``type`` and its ``params``
    (a tuple of ``(name, value)`` pairs over the type's defaults)."""

    SECTION = "scheduler"
    SORTED_KEYS = True

    type: str = setting(check=_schedule_type, help="one of WarmupLR, WarmupDecayLR, WarmupCosineLR")
    params: tuple = setting((), help="the type's parameters over its defaults (DeepSpeed's names)")

    def _check_together(self, where: Where) -> None:
        from hybrid.config.schedule import REQUIRED, SCHEDULES, WARMUP_TYPES

        kind, at = self.type, where("params")
        params = _pairs(at, self.params)
        v.known_keys(at, params, sorted(SCHEDULES[kind]))
        values = {**SCHEDULES[kind], **params}
        for key, value in values.items():
            path = f"{at}.{key}"
            if key == "warmup_type":
                values[key] = v.one_of(path, value, WARMUP_TYPES)
            elif key.endswith("_steps"):
                if value is None and key in REQUIRED:
                    raise ConfigError(f"{path} is required for {kind}; set it to the number of optimizer steps of "
                                      f"the run.")
                values[key] = v.integer(path, value, 1 if key in REQUIRED else 0, whole_floats=True)
            elif value is not None:
                values[key] = _NON_NEGATIVE(path, value)
        if "total_num_steps" in values and values["total_num_steps"] < values["warmup_num_steps"]:
            raise ConfigError(f"{at}.total_num_steps ({values['total_num_steps']}) is below warmup_num_steps "
                              f"({values['warmup_num_steps']}); make the run at least as long as its warmup.")
        self._set("params", tuple(sorted((k, values[k]) for k in params)))

    @property
    def values(self) -> dict:
        from hybrid.config.schedule import SCHEDULES

        return {**SCHEDULES[self.type], **dict(self.params)}


# -- the whole config --------------------------------------------------------------------------------------
def _clipping(path: str, value: Any) -> Optional[float]:
    return _NON_NEGATIVE(path, value) or None  # DeepSpeed writes 0.0 for "off"


@dataclass(frozen=True)
class TrainConfig(Section):
    SORTED_KEYS = True

    zero: ZeroConfig = setting(factory=ZeroConfig, check=section_check(ZeroConfig), deepspeed="zero_optimization",
                               help="the ZeRO policy (ZeroConfig)")
    precision: str = setting("fp32", partial(v.one_of, choices=PRECISIONS),
                             help="bf16 or fp32 (DeepSpeed: bf16: {enabled: true}; fp16 is refused)")
    optimizer: OptimizerConfig = setting(factory=OptimizerConfig, check=section_check(OptimizerConfig, read_optimizer),
                                         help="the optimizer (OptimizerConfig), ours or DeepSpeed's form")
    scheduler: Optional[SchedulerConfig] = setting(None, section_check(SchedulerConfig),
                                                   help="unset: the optimizer's learning rate throughout")
    gradient_clipping: Optional[float] = setting(None, _clipping,
                                                 help="max global gradient norm; unset (or 0) = no clipping")
    gradient_accumulation_steps: Optional[int] = setting(
        None, _size(1), help="unset: derived by check_batch(dp) when both batch sizes are given, else 1")
    micro_batch_size: Optional[int] = setting(None, _size(1), deepspeed="train_micro_batch_size_per_gpu",
                                              help="rows per rank per micro-step (informational, checked)")
    train_batch_size: Optional[int] = setting(None, _size(1),
                                              help="micro_batch_size x gradient_accumulation_steps x dp")
    max_nonfinite_skips: int = setting(5, _size(1),
                                       help="a NaN/inf gradient norm skips the step; this many in a row fail")

    def _check_together(self, where: Where) -> None:
        if self.precision == "fp32" and self.zero.reduce_dtype == "bf16":
            zero = where("zero")
            raise ConfigError(f"{zero}.reduce_dtype is bf16 but precision is fp32: an fp32 model's gradients are "
                              f"reduced in fp32; remove {zero}.reduce_dtype or set precision to bf16.")
        if self.gradient_accumulation_steps is None and not self._derives_accumulation:
            self._set("gradient_accumulation_steps", 1)

    @property
    def _derives_accumulation(self) -> bool:
        """True while ``gradient_accumulation_steps`` waits for ``check_batch(dp)`` to derive it."""
        return (self.gradient_accumulation_steps is None and self.micro_batch_size is not None
                and self.train_batch_size is not None)

    @property
    def grad_precision(self) -> str:
        """The dtype gradients are reduced and accumulated in: ``zero.reduce_dtype``, else the model's."""
        return self.zero.reduce_dtype or self.precision

    def check_batch(self, dp: int) -> "TrainConfig":
        """This config for ``dp`` data-parallel ranks: ``gradient_accumulation_steps`` not given is derived as
        DeepSpeed does (train_batch_size / (micro batch x dp)); given, the three must agree. The engine uses
        the config this returns."""
        if self.micro_batch_size is None or self.train_batch_size is None:
            return self
        rows = self.micro_batch_size * dp
        if self._derives_accumulation:
            if self.train_batch_size % rows:
                raise ConfigError(
                    f"train_batch_size {self.train_batch_size} is not a multiple of micro batch "
                    f"{self.micro_batch_size} x dp {dp} = {rows}, so gradient_accumulation_steps cannot be derived; "
                    f"make train_batch_size a multiple of {rows} or change the micro batch.")
            return replace(self, gradient_accumulation_steps=self.train_batch_size // rows)
        expected = rows * self.gradient_accumulation_steps
        if expected != self.train_batch_size:
            raise ConfigError(
                f"train_batch_size is {self.train_batch_size} but micro batch {self.micro_batch_size} x "
                f"gradient_accumulation_steps {self.gradient_accumulation_steps} x dp {dp} = {expected}; "
                f"fix one of them (or leave gradient_accumulation_steps out to derive it).")
        return self

    @classmethod
    def from_dict(cls, d: dict, prefix: str = "") -> "TrainConfig":
        """Build from our dict or a DeepSpeed-style dict; unknown keys raise ``ConfigError`` (all of a section's
        in one sentence); DeepSpeed settings that do not change the training are ignored with one log line.
        ``prefix`` is where the optimizer and scheduler sections sit in the user's file (``"train."`` for a model
        config's), so that their errors name the path the user wrote."""
        ignored: list = []
        d = drop_deepspeed_knobs(v.mapping("config", d), "", ignored)
        values, where = spelled(cls, d, "", also=("bf16", "fp16"))
        precision = _precision_from(d, values.get("precision"))
        if precision is not None:
            values["precision"] = precision
        cfg = cls(**values, where=where.also(optimizer=f"{prefix}optimizer", scheduler=f"{prefix}scheduler"))
        if ignored:
            log.warning("ignoring DeepSpeed settings that do not change the training here: %s", ", ".join(ignored))
        return cfg


def _precision_from(d: dict, written: Any) -> Any:
    """``precision`` from DeepSpeed's ``bf16: {enabled}`` (and a refused ``fp16``) beside the one ``written``;
    None: neither given (the field's default)."""
    fp16 = v.mapping("fp16", d["fp16"]).get("enabled", False) if d.get("fp16") is not None else False
    if isinstance(fp16, str) and fp16 == "auto":
        raise ConfigError(f"fp16.enabled is \"auto\" ({v.AUTO_PLACEHOLDER}); fp16 is not supported, so set it to "
                          f"false and use bf16 (bf16.enabled: true).")
    if fp16:
        raise ConfigError("fp16.enabled: fp16 is not supported; use bf16 (bf16.enabled: true) instead")
    if "bf16" not in d:
        return written
    bf16 = v.boolean("bf16.enabled", v.mapping("bf16", d["bf16"], ("enabled",)).get("enabled", False))
    if written is None:
        return "bf16" if bf16 else None
    if isinstance(written, str) and written in PRECISIONS and bf16 != (written == "bf16"):
        raise ConfigError(f"precision is {written!r} but bf16.enabled is {bf16}; keep one of them")
    return written
