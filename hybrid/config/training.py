"""Typed training configuration for the ZeRO engine, built from our dict or a DeepSpeed-style dict.

``TrainConfig(zero=ZeroConfig(...), precision="bf16"|"fp32", optimizer=OptimizerConfig(...),
scheduler=None|SchedulerConfig(...), gradient_clipping=None|float, gradient_accumulation_steps=None|int,
max_nonfinite_skips=5)``; accumulation left out is 1, or with both batch sizes given derived by
``check_batch(dp)`` as DeepSpeed does (train_batch_size / (micro batch x dp)). Every field is checked
on construction; a bad value raises ``ConfigError`` naming the field and the fix.

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
pin_memory: true}`` keeps the fp32 master and the optimizer state in host memory (stages 1-3).

Unknown keys are an error that names every unknown key of the section (whole) and lists the accepted ones. Sizes are in
elements, as in DeepSpeed, and may be written as floats (``5e8``) when they are whole numbers.
Defaults follow the seed (bucket sizes 5e8, prefetch 5e7, persistence 1e5, sub-group 1e9) and
``torch.optim.AdamW`` (lr 1e-3, betas (0.9, 0.999), eps 1e-8; weight decay: the named class's default, 0.01
for AdamW, in our form).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import MISSING, dataclass, field, fields, replace
from typing import Any, Callable, Optional

from hybrid.config import validate as v
from hybrid.errors import ConfigError
from hybrid.config.validate import PRECISIONS

log = logging.getLogger(__name__)

# -- value checks: the shared vocabulary, with sizes allowed as whole floats (5e8) as in DeepSpeed ------
def _int(value: Any, name: str, minimum: int) -> int:
    return v.integer(name, value, minimum, whole_floats=True)


def _float(value: Any, name: str, minimum: float = 0.0, strict: bool = False) -> float:
    return v.number(name, value, lo=minimum, lo_open=strict)


def _bool(value: Any, name: str) -> bool:
    return v.boolean(name, value)


def _section(value: Any, name: str) -> dict:
    return v.mapping(name, value)


def _reject_unknown(section: dict, allowed, where: str) -> None:
    v.known_keys(where, section, sorted(allowed))


STAGE3_UNITS = ("auto", "module")  # hybrid.zero.units: which modules are stage-3 unit roots


# -- the typed configs --------------------------------------------------------------------------------------
OFFLOAD_DEVICES = ("none", "cpu")


@dataclass(frozen=True)
class OffloadConfig:
    """Where the fp32 master weights and optimizer state live: ``none`` (the device) or ``cpu`` (host memory,
    pinned when ``pin_memory`` and the device is CUDA)."""

    device: str = "none"
    pin_memory: bool = False

    @property
    def enabled(self) -> bool:
        return self.device != "none"


def _offload_from(value: Any, where: str) -> OffloadConfig:
    if isinstance(value, OffloadConfig):
        return value
    if value is None:
        return OffloadConfig()
    section = _section(value, where)
    _reject_unknown(section, ("device", "pin_memory"), where)
    device = section.get("device", "none")
    if device == "nvme":
        raise ConfigError(f"{where}.device nvme is not supported (only host memory is); use device: cpu, or "
                          f"device: none to keep the optimizer state on the GPU.")
    device = v.one_of(f"{where}.device", "none" if device is None else device, OFFLOAD_DEVICES)
    return OffloadConfig(device, _bool(section.get("pin_memory", False), f"{where}.pin_memory"))


@dataclass(frozen=True)
class ZeroConfig:
    """ZeRO policy on the data-parallel group. Sizes count elements, not bytes."""

    stage: int = 0
    reduce_bucket_size: int = 500_000_000      # stages 0-2: gradient bucket (one collective each)
    allgather_bucket_size: int = 500_000_000   # stages 1-2: elements in flight in the post-step all-gather
    prefetch_bucket_size: int = 50_000_000     # stage 3: elements gathered ahead of the running module
    param_persistence_threshold: int = 100_000  # stage 3: params with fewer elements stay gathered
    sub_group_size: int = 1_000_000_000        # optimizer steps the shard in pieces of this many elements
    overlap_comm: bool = True                  # keep gradient collectives in flight during backward
    reduce_scatter: bool = True                # stages 1-3: reduce-scatter (else all-reduce) gradients
    contiguous_gradients: bool = True          # accepted for DeepSpeed configs; gradients are always flat
    offload_optimizer: OffloadConfig = field(default_factory=OffloadConfig)  # stages 1-3: states in host memory
    stage3_unit: Any = "auto"                  # stage 3: auto | module | callable(name, module) -> bool
    reduce_dtype: Optional[str] = None         # gradients summed/accumulated in: fp32 | bf16; None = the model's

    def __post_init__(self) -> None:
        _check_zero(self, "zero")


def _check_zero(cfg: ZeroConfig, where: str) -> None:
    set_ = lambda k, v: object.__setattr__(cfg, k, v)  # noqa: E731  (frozen dataclass)
    set_("stage", v.stage(f"{where}.stage", cfg.stage, whole_floats=True))
    for name in ("reduce_bucket_size", "allgather_bucket_size", "prefetch_bucket_size", "sub_group_size"):
        set_(name, _int(getattr(cfg, name), f"{where}.{name}", 1))
    set_("param_persistence_threshold",
         _int(cfg.param_persistence_threshold, f"{where}.param_persistence_threshold", 0))
    for name in ("overlap_comm", "reduce_scatter", "contiguous_gradients"):
        set_(name, _bool(getattr(cfg, name), f"{where}.{name}"))
    unit = cfg.stage3_unit
    if not callable(unit) and unit not in STAGE3_UNITS:
        raise ConfigError(f"{where}.stage3_unit must be auto, module or a function (module_name, module) -> bool "
                          f"marking the unit roots, got {unit!r}; use auto (one unit per block) unless you "
                          f"need another cut.")
    if cfg.reduce_dtype is not None:
        set_("reduce_dtype", v.one_of(f"{where}.reduce_dtype", cfg.reduce_dtype, PRECISIONS))
    offload = _offload_from(cfg.offload_optimizer, f"{where}.offload_optimizer")
    set_("offload_optimizer", offload)
    from hybrid.config.stage_policy import policy_for  # pure table; imported here to keep config import-light

    if offload.enabled and not policy_for(cfg.stage).shard_optimizer:
        raise ConfigError(f"{where}.offload_optimizer needs ZeRO stage 1, 2 or 3, but {where}.stage is {cfg.stage}: "
                          f"stage 0 keeps a full optimizer copy on every rank, so offloading it would move "
                          f"N times the bytes; set {where}.stage to 1 or more, or offload_optimizer.device: none.")


IMPLEMENTATIONS = ("auto", "fused", "foreach", "for-loop")
# torch.optim classes whose state is not one tensor per element (or that need a closure): refused by name
NOT_ELEMENTWISE = ("lbfgs", "sparseadam", "adafactor", "muon")
_TORCH_MANAGED = {"params", "foreach", "fused", "capturable", "differentiable"}


def torch_optimizer_class(kind: str, decoupled: bool = True, where: str = "optimizer.type"):
    """The ``torch.optim`` class named ``kind`` (any case); ``Adam``/``AdamW`` follow ``decoupled``."""
    import torch  # lazily: the config module is read on the driver too

    if not isinstance(kind, str) or not kind:
        raise v.invalid(where, "the name of a torch.optim optimizer (AdamW, Adam, SGD, ...)", kind)
    if kind.lower() in ("adam", "adamw"):
        return torch.optim.AdamW if decoupled else torch.optim.Adam
    if kind.lower() in NOT_ELEMENTWISE:
        raise ConfigError(f"{where} is {kind}, whose state is not one value per parameter element, so it cannot "
                          f"be stepped on ZeRO's flat shards; use an elementwise optimizer such as AdamW or SGD.")
    names = {n.lower(): n for n in dir(torch.optim) if isinstance(getattr(torch.optim, n), type)
             and issubclass(getattr(torch.optim, n), torch.optim.Optimizer) and n != "Optimizer"}
    if kind.lower() not in names:
        known = sorted(n for n in names.values() if n.lower() not in NOT_ELEMENTWISE)
        raise v.invalid(where, "one of " + ", ".join(known), kind)
    return getattr(torch.optim, names[kind.lower()])


def optimizer_kwargs_allowed(cls) -> tuple:
    """The keyword arguments of ``cls`` a config may set (torch's own implementation switches excluded)."""
    import inspect

    names = list(inspect.signature(cls.__init__).parameters)[1:]
    return tuple(n for n in names if n not in _TORCH_MANAGED)


# DeepSpeed's optimizers (FusedAdam, DeepSpeedCPUAdam, FusedLamb, ...) decay nothing unless told: a DeepSpeed-style
# optimizer section ({"type": ..., "params": {...}}) without weight_decay gets this, whatever torch's default.
DEEPSPEED_WEIGHT_DECAY = 0.0
# ... and decay every parameter they are given: in that form no parameter is exempted unless no_decay says so
# (ours exempts biases, norms and embeddings: no_decay "auto").
DEEPSPEED_NO_DECAY = "none"


def default_weight_decay(kind: str, decoupled: bool = True) -> float:
    """The weight decay of ``torch.optim.<kind>`` when none is given: its constructor's default (AdamW 0.01;
    Adam 0 even where it runs as AdamW, as DeepSpeed's Adam; SGD, RMSprop, Adagrad 0)."""
    import inspect

    import torch

    cls = torch.optim.Adam if kind.lower() == "adam" else torch_optimizer_class(kind, decoupled)
    param = inspect.signature(cls.__init__).parameters.get("weight_decay")
    default = param.default if param is not None else inspect.Parameter.empty
    return 0.0 if default is inspect.Parameter.empty else float(default)


@dataclass(frozen=True)
class OptimizerConfig:
    """AdamW (decoupled weight decay) by default; ``decoupled_weight_decay=False`` is Adam with L2.

    ``type`` names any elementwise ``torch.optim`` class; ``extra`` holds its other keyword arguments
    (``(("momentum", 0.9),)``). ``no_decay``: ``"auto"`` (1-D parameters and embedding weights get no weight
    decay), ``"none"`` or a tuple of name patterns (fnmatch). ``param_groups``: a tuple of
    ``{"names": (patterns...), "weight_decay": x, "lr_scale": y}`` (either key optional), first match wins.
    """

    lr: float = 1e-3
    betas: tuple = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: Optional[float] = None  # None: the torch class's own default (AdamW 0.01, Adam and SGD 0)
    decoupled_weight_decay: bool = True
    type: str = "AdamW"
    extra: tuple = ()
    no_decay: Any = "auto"
    param_groups: tuple = ()
    implementation: str = "auto"

    def __post_init__(self) -> None:
        _check_optimizer(self, "optimizer")

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


def _check_optimizer(cfg: OptimizerConfig, where: str) -> None:
    set_ = lambda k, v: object.__setattr__(cfg, k, v)  # noqa: E731
    set_("lr", _float(cfg.lr, f"{where}.lr"))
    betas = cfg.betas
    if not isinstance(betas, (list, tuple)) or len(betas) != 2:
        raise v.invalid(f"{where}.betas", "a pair [beta1, beta2]", betas)
    b1, b2 = (_float(b, f"{where}.betas") for b in betas)
    if not (b1 < 1.0 and b2 < 1.0):
        raise v.invalid(f"{where}.betas", "two numbers in [0, 1)", list(betas))
    set_("betas", (b1, b2))
    set_("eps", _float(cfg.eps, f"{where}.eps", strict=True))
    set_("decoupled_weight_decay", _bool(cfg.decoupled_weight_decay, f"{where}.decoupled_weight_decay"))
    cls = torch_optimizer_class(cfg.type, cfg.decoupled_weight_decay, f"{where}.type")
    decay = default_weight_decay(cfg.type, cfg.decoupled_weight_decay) if cfg.weight_decay is None else cfg.weight_decay
    set_("weight_decay", _float(decay, f"{where}.weight_decay"))
    extra = dict(cfg.extra)
    allowed = optimizer_kwargs_allowed(cls)
    for key in extra:
        if key not in allowed:
            raise ConfigError(f"{where}.{key} is not a setting of torch.optim.{cls.__name__}; use one of: "
                              f"{', '.join(allowed)}.")
    set_("extra", tuple(sorted(extra.items())))
    ours = where.removesuffix(".params")  # our keys sit beside type and params, in either spelling
    set_("no_decay", _no_decay(cfg.no_decay, f"{ours}.no_decay"))
    set_("param_groups", tuple(_param_group(g, f"{ours}.param_groups[{n}]") for n, g in
                               enumerate(_list(cfg.param_groups, f"{ours}.param_groups"))))
    set_("implementation", v.one_of(f"{ours}.implementation", cfg.implementation, IMPLEMENTATIONS))


def _list(value: Any, where: str) -> list:
    if isinstance(value, (list, tuple)):
        return list(value)
    raise v.invalid(where, "a list", value)


def _patterns(value: Any, where: str) -> tuple:
    items = [value] if isinstance(value, str) else _list(value, where)
    return tuple(v.text(where, item, "a list of parameter name patterns (strings)") for item in items)


def _no_decay(value: Any, where: str):
    if value in ("auto", "none"):
        return value
    if not isinstance(value, (str, list, tuple)):
        raise v.invalid(where, "'auto', 'none' or a list of parameter name patterns", value)
    return _patterns(value, where)


def _param_group(value: Any, where: str) -> dict:
    group = v.mapping(where, value, ("names", "weight_decay", "lr_scale"), example="{names: ['*.bias'], lr_scale: 2}")
    out = {"names": _patterns(v.required(group, where, "names", "a list of parameter name patterns"),
                              f"{where}.names")}
    for key in ("weight_decay", "lr_scale"):
        if key in group:
            out[key] = _float(group[key], f"{where}.{key}")
    return out


@dataclass(frozen=True)
class SchedulerConfig:
    """A DeepSpeed learning-rate schedule (``hybrid.config.schedule.SCHEDULES``): ``type`` and its ``params``
    (a tuple of ``(name, value)`` pairs over the type's defaults)."""

    type: str
    params: tuple = ()

    def __post_init__(self) -> None:
        _check_scheduler(self, "scheduler")

    @property
    def values(self) -> dict:
        from hybrid.config.schedule import SCHEDULES

        return {**SCHEDULES[self.type], **dict(self.params)}


def _check_scheduler(cfg: SchedulerConfig, where: str) -> None:
    from hybrid.config.schedule import REQUIRED, SCHEDULES, WARMUP_TYPES

    kind = v.one_of(f"{where}.type", cfg.type, tuple(SCHEDULES))
    params = dict(cfg.params)
    _reject_unknown(params, SCHEDULES[kind], f"{where}.params")
    values = {**SCHEDULES[kind], **params}
    for key, value in values.items():
        path = f"{where}.params.{key}"
        if key == "warmup_type":
            values[key] = v.one_of(path, value, WARMUP_TYPES)
        elif key.endswith("_steps"):
            if value is None and key in REQUIRED:
                raise ConfigError(f"{path} is required for {kind}; set it to the number of optimizer steps of "
                                  f"the run.")
            values[key] = _int(value, path, 1 if key in REQUIRED else 0)
        elif value is not None:
            values[key] = _float(value, path)
    if "total_num_steps" in values and values["total_num_steps"] < values["warmup_num_steps"]:
        raise ConfigError(f"{where}.params.total_num_steps ({values['total_num_steps']}) is below "
                          f"warmup_num_steps ({values['warmup_num_steps']}); make the run at least as long as its "
                          f"warmup.")
    object.__setattr__(cfg, "type", kind)
    object.__setattr__(cfg, "params", tuple(sorted((k, values[k]) for k in params)))


@dataclass(frozen=True)
class TrainConfig:
    zero: ZeroConfig = field(default_factory=ZeroConfig)
    precision: str = "fp32"
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    scheduler: Optional[SchedulerConfig] = None  # None: the optimizer's learning rate throughout
    gradient_clipping: Optional[float] = None   # max global gradient norm; None (or 0) = no clipping
    gradient_accumulation_steps: Optional[int] = None  # None: derived by check_batch(dp) when both batch sizes
    micro_batch_size: Optional[int] = None      # are given, else 1. Per rank; informational, checked against
    train_batch_size: Optional[int] = None      # train_batch_size = micro_batch_size * accumulation * dp
    max_nonfinite_skips: int = 5                # a NaN/inf gradient norm skips the step; this many in a row fail

    def __post_init__(self) -> None:
        set_ = lambda k, v: object.__setattr__(self, k, v)  # noqa: E731
        if not isinstance(self.zero, ZeroConfig):
            raise ConfigError(f"zero must be a ZeroConfig, got {type(self.zero).__name__}")
        if not isinstance(self.optimizer, OptimizerConfig):
            raise ConfigError(f"optimizer must be an OptimizerConfig, got {type(self.optimizer).__name__}")
        if self.scheduler is not None and not isinstance(self.scheduler, SchedulerConfig):
            raise ConfigError(f"scheduler must be a SchedulerConfig, got {type(self.scheduler).__name__}")
        v.one_of("precision", self.precision, PRECISIONS)
        if self.precision == "fp32" and self.zero.reduce_dtype == "bf16":
            raise ConfigError("zero.reduce_dtype is bf16 but precision is fp32: an fp32 model's gradients are "
                              "reduced in fp32; remove zero.reduce_dtype or set precision to bf16.")
        clip = self.gradient_clipping
        if clip is not None:
            clip = _float(clip, "gradient_clipping") or None  # DeepSpeed writes 0.0 for "off"
        set_("gradient_clipping", clip)
        set_("max_nonfinite_skips", _int(self.max_nonfinite_skips, "max_nonfinite_skips", 1))
        for name in ("micro_batch_size", "train_batch_size"):
            if getattr(self, name) is not None:
                set_(name, _int(getattr(self, name), name, 1))
        accumulation = self.gradient_accumulation_steps
        if accumulation is not None:
            set_("gradient_accumulation_steps", _int(accumulation, "gradient_accumulation_steps", 1))
        elif not self._derives_accumulation:
            set_("gradient_accumulation_steps", 1)

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
        cfg = _from_dict(_drop_deepspeed_knobs(_section(d, "config"), "", ignored), prefix)
        if ignored:
            log.warning("ignoring DeepSpeed settings that do not change the training here: %s", ", ".join(ignored))
        return cfg


# -- DeepSpeed settings hybrid has no field for: ignored where they cannot change the training, else refused ----
@dataclass(frozen=True)
class _Knob:
    """A DeepSpeed setting without a field here: values for which ``harmless`` holds change nothing (performance,
    logging, checkpoint format) and are ignored; any other value is refused with ``why`` (reason and fix)."""

    harmless: Callable[[Any], bool] = lambda value: True
    why: str = ""


def _only(expected: Any) -> Callable[[Any], bool]:
    """Harmless only as ``expected`` (``True`` never passes for ``1``)."""
    return lambda value: isinstance(value, bool) == isinstance(expected, bool) and value == expected


def _no_param_offload(value: Any) -> bool:
    return value is None or isinstance(value, Mapping) and value.get("device", "none") in ("none", None)


_IGNORED = _Knob()
# The one list, by DeepSpeed path (a "zero" section is read as "zero_optimization").
DEEPSPEED_KNOBS = {
    **{key: _IGNORED for key in (
        "steps_per_print", "wall_clock_breakdown", "zero_allow_untested_optimizer", "zero_force_ds_cpu_optimizer",
        "memory_breakdown", "dump_state", "tensorboard", "wandb", "csv_monitor", "comms_logger", "flops_profiler",
        "bf16.immediate_grad_update",
        "zero_optimization.stage3_max_live_parameters", "zero_optimization.stage3_max_reuse_distance",
        "zero_optimization.round_robin_gradients", "zero_optimization.stage3_gather_16bit_weights_on_model_save",
        "zero_optimization.stage3_gather_fp16_weights_on_model_save", "zero_optimization.load_from_fp32_weights",
        "zero_optimization.ignore_unused_parameters", "zero_optimization.memory_efficient_linear",
        "zero_optimization.elastic_checkpoint",
        "zero_optimization.allgather_partitions",  # false: broadcasts instead of an all-gather, the same values
        "zero_optimization.offload_optimizer.buffer_count", "zero_optimization.offload_optimizer.fast_init",
        "zero_optimization.offload_optimizer.pipeline_read", "zero_optimization.offload_optimizer.pipeline_write",
        "zero_optimization.offload_optimizer.nvme_path")},
    "zero_optimization.offload_optimizer.ratio": _Knob(_only(1.0), "other than 1.0 (offloading part of the "
                                                       "optimizer) is not supported; remove it: all of it is offloaded"),
    "zero_optimization.offload_param": _Knob(_no_param_offload, "(ZeRO-Infinity parameter offload) is not "
                                             "supported; remove it (offload_optimizer: {device: cpu} is supported)"),
    "zero_optimization.zero_quantized_weights": _Knob(_only(False), "(ZeRO++ quantized weight gathers) would "
                                                      "change the weights each step computes with; remove it"),
    "zero_optimization.zero_quantized_nontrainable_weights": _Knob(_only(False), "(ZeRO++ quantized frozen "
                                                                   "weights) would change them; remove it"),
    "zero_optimization.zero_quantized_gradients": _Knob(_only(False), "(ZeRO++ quantized gradient reduction) "
                                                        "would change the gradients; remove it"),
    "zero_optimization.zero_hpz_partition_size": _Knob(_only(1), "(ZeRO++ hierarchical partitioning) is not "
                                                       "supported; remove it"),
    # either value averages the gradients over DP, as here: the loss pre-divided by the DP size, or AVG in
    # the collective where the backend has it (NCCL); the two orders differ only in rounding
    "prescale_gradients": _Knob(lambda value: isinstance(value, bool), "must be true or false"),
    "communication_data_type": _Knob(lambda value: value is None, "is not a setting here; use "
                                     "zero_optimization.reduce_dtype (fp32 or bf16) for the dtype gradients are "
                                     "reduced in"),
    "data_types": _Knob(lambda value: not value, "is not a setting here; use zero_optimization.reduce_dtype "
                        "(fp32 or bf16) for the dtype gradients are reduced and accumulated in"),
    "gradient_predivide_factor": _Knob(_only(1.0), "other than 1.0 is not supported: gradients are averaged in "
                                       "one fixed order here; remove it"),
    "activation_checkpointing": _Knob(lambda value: not value, "(DeepSpeed's checkpointing API settings) has no "
                                      "effect here; remove it, and checkpoint activations in the model "
                                      "(torch.utils.checkpoint, or parallel.activation_checkpointing for the "
                                      "built-in GPT)"),
}


def _deepspeed_path(path: str) -> str:
    """``path`` as the DeepSpeed spelling names it in ``DEEPSPEED_KNOBS``."""
    return "zero_optimization" + path[4:] if path == "zero" or path.startswith("zero.") else path


def _drop_deepspeed_knobs(section: dict, where: str, ignored: list) -> dict:
    """``section`` without the ``DEEPSPEED_KNOBS`` set to a harmless value (their paths appended to ``ignored``);
    one set to another value raises its reason."""
    out = {}
    for key, value in section.items():
        path = v.join(where, key)
        knob = DEEPSPEED_KNOBS.get(_deepspeed_path(path)) if isinstance(key, str) else None
        if knob is None:
            below = _deepspeed_path(path) + "."
            nested = isinstance(value, Mapping) and any(name.startswith(below) for name in DEEPSPEED_KNOBS)
            out[key] = _drop_deepspeed_knobs(value, path, ignored) if nested else value
        elif knob.harmless(value):
            ignored.append(path)
        else:
            raise ConfigError(f"{path} {knob.why}.")
    return out


# -- dict parsing ------------------------------------------------------------------------------------------
_ZERO_ALIASES = {"stage3_prefetch_bucket_size": "prefetch_bucket_size",
                 "stage3_param_persistence_threshold": "param_persistence_threshold"}
_ZERO_KEYS = {f.name for f in fields(ZeroConfig)} | set(_ZERO_ALIASES)
_OPT_OURS = ("no_decay", "param_groups", "implementation")  # beside type/params, in either spelling
_TOP_KEYS = {"zero", "zero_optimization", "precision", "bf16", "fp16", "optimizer", "scheduler", "gradient_clipping",
             "gradient_accumulation_steps", "micro_batch_size", "train_micro_batch_size_per_gpu",
             "train_batch_size", "max_nonfinite_skips"}


def _from_dict(d: dict, prefix: str = "") -> TrainConfig:
    _reject_unknown(d, _TOP_KEYS, "")
    kwargs: dict = {}
    kwargs["zero"] = _zero_from(d)
    kwargs["precision"] = _precision_from(d)
    kwargs["optimizer"] = _optimizer_from(d.get("optimizer"), f"{prefix}optimizer")
    if d.get("scheduler") is not None:
        kwargs["scheduler"] = _scheduler_from(d["scheduler"], f"{prefix}scheduler")
    for key in ("gradient_clipping", "gradient_accumulation_steps", "train_batch_size", "max_nonfinite_skips"):
        if key in d:
            kwargs[key] = d[key]
    micro = [k for k in ("micro_batch_size", "train_micro_batch_size_per_gpu") if k in d]
    if len(micro) > 1:
        raise ConfigError("micro_batch_size and train_micro_batch_size_per_gpu are both set; keep one")
    if micro:
        kwargs["micro_batch_size"] = _int(d[micro[0]], micro[0], 1)
    return TrainConfig(**kwargs)


def _zero_from(d: dict) -> ZeroConfig:
    present = [k for k in ("zero", "zero_optimization") if k in d]
    if len(present) > 1:
        raise ConfigError("zero and zero_optimization are both set; keep one")
    if not present:
        return ZeroConfig()
    where = present[0]
    section = _section(d[where], where)
    _reject_unknown(section, _ZERO_KEYS, where)
    values: dict = {}
    for key, value in section.items():
        name = _ZERO_ALIASES.get(key, key)
        if name in values:
            raise ConfigError(f"{where}.{name} is set twice (also as {key}); keep one")
        values[name] = value
    cfg = ZeroConfig.__new__(ZeroConfig)  # validate under the user's section name, then construct
    for f in fields(ZeroConfig):
        object.__setattr__(cfg, f.name, values.get(f.name, None if f.default is MISSING else f.default))
    _check_zero(cfg, where)
    return ZeroConfig(**{f.name: getattr(cfg, f.name) for f in fields(ZeroConfig)})


def _precision_from(d: dict) -> str:
    fp16 = _section(d["fp16"], "fp16").get("enabled", False) if d.get("fp16") is not None else False
    if isinstance(fp16, str) and fp16 == "auto":
        raise ConfigError(f"fp16.enabled is \"auto\" ({v.AUTO_PLACEHOLDER}); fp16 is not supported, so set it to "
                          f"false and use bf16 (bf16.enabled: true).")
    if fp16:
        raise ConfigError("fp16.enabled: fp16 is not supported; use bf16 (bf16.enabled: true) instead")
    bf16 = None
    if "bf16" in d:
        section = _section(d["bf16"], "bf16")
        _reject_unknown(section, {"enabled"}, "bf16")
        bf16 = _bool(section.get("enabled", False), "bf16.enabled")
    if "precision" in d:
        precision = v.one_of("precision", d["precision"], PRECISIONS)
        if bf16 is not None and bf16 != (precision == "bf16"):
            raise ConfigError(f"precision is {precision!r} but bf16.enabled is {bf16}; keep one of them")
        return precision
    return "bf16" if bf16 else "fp32"


def _optimizer_from(section, name: str = "optimizer") -> OptimizerConfig:
    if section is None:
        return OptimizerConfig()
    section = _section(section, name)
    ours = {k: section[k] for k in _OPT_OURS if k in section}
    if "params" in section:  # DeepSpeed: {"type": ..., "params": {...}}
        _reject_unknown(section, {"type", "params", *_OPT_OURS}, name)
        ours.setdefault("no_decay", DEEPSPEED_NO_DECAY)
        where, params = f"{name}.params", dict(_section(section["params"], f"{name}.params"))
    else:
        where, params = name, {k: val for k, val in section.items() if k != "type" and k not in _OPT_OURS}
    kind = section.get("type", "AdamW")
    given = [k for k in ("decoupled_weight_decay", "adam_w_mode") if k in params]
    values = {k: _bool(params.pop(k), f"{where}.{k}") for k in given}
    if len(set(values.values())) > 1:
        raise ConfigError(f"{where}.decoupled_weight_decay and {where}.adam_w_mode disagree (torch's and "
                          f"DeepSpeed's name for the same switch); keep one of them.")
    decoupled = values[given[0]] if given else True
    if isinstance(kind, str) and kind.lower() == "adamw" and not decoupled:
        raise ConfigError(f"{where}.{given[0]} is false but {name}.type is AdamW; use type Adam for L2 decay")
    cls = torch_optimizer_class(kind, decoupled, f"{name}.type")
    flat = {"type", "params"} if "params" not in section else set()  # named in the list of what may go here
    _reject_unknown(params, set(optimizer_kwargs_allowed(cls)) | {"adam_w_mode", "decoupled_weight_decay"} | flat,
                    where)
    params.setdefault("weight_decay", DEEPSPEED_WEIGHT_DECAY if "params" in section else
                      default_weight_decay(kind, decoupled))  # plain: the class named, not the one run
    plain = ("lr", "betas", "eps", "weight_decay")
    cfg = OptimizerConfig.__new__(OptimizerConfig)
    for f in fields(OptimizerConfig):
        object.__setattr__(cfg, f.name, params.get(f.name, f.default) if f.name in plain else f.default)
    for key, value in ours.items():
        object.__setattr__(cfg, key, value)
    object.__setattr__(cfg, "decoupled_weight_decay", decoupled)
    object.__setattr__(cfg, "type", cls.__name__)
    object.__setattr__(cfg, "extra", tuple((k, val) for k, val in params.items() if k not in plain))
    _check_optimizer(cfg, where)
    return OptimizerConfig(**{f.name: getattr(cfg, f.name) for f in fields(OptimizerConfig)})


def _scheduler_from(section, name: str = "scheduler") -> SchedulerConfig:
    section = _section(section, name)
    _reject_unknown(section, {"type", "params"}, name)
    params = _section(section.get("params", {}), f"{name}.params")
    cfg = SchedulerConfig.__new__(SchedulerConfig)
    object.__setattr__(cfg, "type", section.get("type"))
    object.__setattr__(cfg, "params", tuple(params.items()))
    _check_scheduler(cfg, name)
    return SchedulerConfig(cfg.type, cfg.params)
