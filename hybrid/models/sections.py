"""The model config's sections the built-in loops share (the GPT's ``hybrid.models.gpt.training`` and the
transformers model's ``hybrid.models.hf``): ``train:`` (``TrainOptions``: learning rate, weight decay, clipping, the
optimizer and scheduler sections), ``zero:`` (ZeroConfig sizes but the stage, which is the plan's), ``data:``
(a token file, relative to the model config) and ``eval:`` (``EvalOptions``: held-out evaluation, and the held-out
stream it names: ``held_out_stream``), and the engine's ``TrainConfig`` they make with the plan's stage,
precision and levers (``training_config``) and ``zero`` keys with the plan's link options (``planned_zero``)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Callable, Mapping, Optional

from hybrid.config import schema
from hybrid.config import validate as v
from hybrid.config.schema import Section, optional, setting
from hybrid.errors import ConfigError


@dataclass(frozen=True)
class TrainOptions(Section):
    """The model config's optional ``train:`` mapping for the built-in entrypoint (``hybrid.models.gpt.training``):
    ``lr`` and ``weight_decay`` are the optimizer's defaults, ``optimizer`` and ``scheduler`` the sections of
    ``hybrid.config.TrainConfig.from_dict``, ``branching`` the synthetic chain's successors per token."""

    SECTION = "train"

    lr: float = setting(5e-3, v.positive_number, yaml_number=True,
                        help="the learning rate (the optimizer's, unless train.optimizer sets one)")
    weight_decay: float = setting(0.0, partial(v.number, lo=0), yaml_number=True,
                                  help="the weight decay (the optimizer's, unless train.optimizer sets one)")
    gradient_clipping: Optional[float] = setting(1.0, optional(partial(v.number, lo=0)), yaml_number=True,
                                                 help="max global gradient norm; null or 0: no clipping")
    branching: int = setting(4, v.positive_int, help="successors per token in the synthetic chain")
    optimizer: Optional[dict] = setting(None, v.mapping, help="{type: SGD, params: {momentum: 0.9}}, no_decay, ...")
    scheduler: Optional[dict] = setting(None, v.mapping, help="{type: WarmupCosineLR, params: {...}}")


TRAIN_DEFAULTS = schema.defaults(TrainOptions)  # the train: section's defaults (declared in TrainOptions)


@dataclass(frozen=True)
class EvalOptions(Section):
    """The model config's optional ``eval:`` mapping: the loss on held-out data, without gradients, every ``every``
    steps and at the last step, over ``batches`` batches of ``job.micro_batch`` rows per DP rank
    (``hybrid.runtime.evaluate``). The held-out data is ``data`` (a second token file, relative to the model
    config) or ``fraction`` (the last F of the windows of the training token file, ``data:``, which training then
    never reads); with neither, training on the synthetic chain is evaluated on chain sequences it never draws."""

    SECTION = "eval"

    every: int = setting(0, partial(v.integer, lo=0), help="evaluate every this many steps (0: only at the "
                                                           "last step, which is always evaluated)")
    batches: int = setting(4, v.positive_int, help="held-out batches per evaluation (job.micro_batch rows per rank)")
    data: Optional[str] = setting(None, partial(v.text, need="the path of a token file"),
                                  help="a held-out token file (relative to the model config)")
    fraction: Optional[float] = setting(None, partial(v.number, lo=0, hi=1, lo_open=True, hi_open=True),
                                        yaml_number=True, help="hold out the last F of data:'s windows")

    def _check_together(self, where) -> None:
        if self.data is not None and self.fraction is not None:
            raise ConfigError(f"{where('data')} and {where('fraction')} are both set; keep one (a held-out token "
                              "file, or the held-out tail of the training data).")


EVAL_EXAMPLE = "{fraction: 0.05, every: 20, batches: 4}"


def eval_options(section: Any, training_data: Any = None) -> Optional[EvalOptions]:
    """The ``eval:`` mapping of the model config checked (None: no evaluation); ``training_data`` is the model
    config's ``data:`` entry (None: the synthetic chain). Training on a token file needs held-out data
    (``eval.fraction`` or ``eval.data``: its own windows would not be held out), and ``eval.fraction`` needs a
    training token file to hold out from."""
    if section is None:
        return None
    options = schema.read(EvalOptions, section, "eval", example=EVAL_EXAMPLE)
    if training_data is not None and options.data is None and options.fraction is None:
        raise ConfigError("eval has no held-out data while training reads the token file of data:; set "
                          "eval.fraction (0.05: the last 5 % of its windows, which training then never reads) "
                          "or eval.data (a second token file).")
    if training_data is None and options.fraction is not None:
        raise ConfigError(f"eval.fraction is {options.fraction:g}, but the model config has no data: token file to "
                          "hold it out from (training reads the synthetic chain); remove eval.fraction (the chain "
                          "is evaluated on sequences training never draws) or set data:.")
    return options


def held_out_stream(options: Optional[EvalOptions], stream: Any, model_config_path: Optional[str],
                    open_file: Callable[[Path], Any]) -> tuple[Any, Any]:
    """``(training stream, held-out stream)`` for ``eval:`` ``options`` (checked by ``eval_options``) and the
    training ``stream``: the held-out tail of its token file (``eval.fraction``; the training stream returned
    reads only what is left), the token file ``eval.data`` (``open_file(path)``, path resolved against the model
    config's directory), or, for the synthetic chain, its sequences training never draws; no held-out stream
    without ``options``."""
    from hybrid.runtime import evaluate

    if options is None:
        return stream, None
    if options.data is not None:
        return stream, open_file(data_path(options.data, model_config_path, field="eval.data"))
    if options.fraction is not None:
        return evaluate.split_held_out(stream, options.fraction, field="eval.fraction")
    return stream, evaluate.UnseenSteps(stream)


def data_path(value: Any, model_config_path: Optional[str], field: str = "data") -> Optional[Path]:
    """The ``data:`` entry of the model config (or another ``field`` naming a token file) as a path (relative
    ones against the config's directory)."""
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise ConfigError(f"{field} is {value!r} in the model config; give the path of a token file made by "
                          "`hybrid data prepare`.")
    path = Path(value).expanduser()
    if not path.is_absolute() and model_config_path:
        path = (Path(model_config_path).resolve().parent / path).resolve()
    return path


def train_options(section: Any) -> dict:
    """The ``train:`` mapping of the model config (``TrainOptions``: its defaults under what is written, each
    value checked, unknown keys refused) as a dict; the optimizer and scheduler sections checked too."""
    if section is None:
        return dict(TRAIN_DEFAULTS)
    options = schema.read(TrainOptions, section, "train", example="{lr: 0.005}")
    _one_place_each(section, options.optimizer)
    options = {f.name: getattr(options, f.name) for f in dataclasses.fields(options)}
    training_config(options, stage=1, precision="fp32")  # every optimizer/scheduler field checked up front
    return options


def _one_place_each(section: Mapping, optimizer: Optional[dict]) -> None:
    """``train.lr`` / ``train.weight_decay`` are the optimizer's defaults: one the user also wrote under
    ``train.optimizer`` (or its ``params``) with another value would be silently overridden, so it is refused."""
    if not optimizer:
        return
    inner = optimizer.get("params") if isinstance(optimizer.get("params"), Mapping) else optimizer
    where = "train.optimizer.params" if inner is not optimizer else "train.optimizer"
    for key in ("lr", "weight_decay"):
        if key in section and key in inner and v.yaml_number(section[key]) != v.yaml_number(inner[key]):
            raise ConfigError(f"train.{key}={v.quote(section[key])} and {where}.{key}={v.quote(inner[key])} "
                              f"disagree; set {key} in one place (remove one of them).")


def training_config(options: dict, stage: int, precision: str, offload=False, zero: Optional[dict] = None,
                    accumulation: int = 1, nvme_path: Optional[str] = None):
    """The engine's ``TrainConfig`` from checked ``train:`` options, the job's stage and precision, optimizer
    offload (``ctx.settings.offload``: False, True for host memory, ``"nvme"`` for the node's disk at
    ``nvme_path``, ``ctx.settings.nvme_path``), ``zero`` sizes (``zero_options``) and gradient accumulation
    steps."""
    from hybrid.config.training import TrainConfig

    optimizer = dict(options.get("optimizer") or {})
    defaults = {"lr": float(options["lr"]), "weight_decay": float(options["weight_decay"])}
    if "params" in optimizer:
        optimizer["params"] = {**defaults, **v.mapping("train.optimizer.params", optimizer["params"])}
    else:
        optimizer = {**defaults, **optimizer}
    zero = {**(zero or {}), "stage": stage}
    if offload == "nvme":
        if nvme_path is None:
            raise ConfigError("the plan offloads the optimizer states to NVMe (parallel.offload), but "
                              "training_config got no nvme_path; pass nvme_path=ctx.settings.nvme_path.")
        zero["offload_optimizer"] = {"device": "nvme", "path": nvme_path, "pin_memory": True}
    elif offload:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    return TrainConfig.from_dict({"zero": zero, "precision": precision, "optimizer": optimizer,
                                  "scheduler": options.get("scheduler"),
                                  "gradient_clipping": options["gradient_clipping"],
                                  "gradient_accumulation_steps": accumulation}, prefix="train.")


def zero_options(section: Any) -> dict:
    """The ``zero:`` mapping of the model config (ZeroConfig fields but ``stage``), each value checked."""
    import dataclasses

    from hybrid.config.training import ZeroConfig

    if section is None:
        return {}
    if isinstance(section, dict) and "offload_optimizer" in section:
        raise ConfigError("zero.offload_optimizer in the model config is not read: a launched job's optimizer "
                          "offload is the cluster file's parallel.offload (auto, true, nvme or false); remove it here "
                          "and set that instead.")
    names = [f.name for f in dataclasses.fields(ZeroConfig) if f.name not in ("stage", "offload_optimizer")]
    options = dict(v.mapping("zero", section, names, example="{reduce_bucket_size: 1000000}"))
    # every field checked, named zero.<field>; at stage 3, which takes every option: the plan's stage is not
    # known here, and training_config checks the options against it
    ZeroConfig(**{**options, "stage": 3})
    return options


LINK_KEYS = ("shard_group", "hierarchical", "secondary_shard", "quantized_weights", "quantized_gradients")


def with_plan_links(links: Optional[dict], zero: dict) -> dict:
    """``zero`` (the model config's checked ``zero:``) with the plan's link options (``links``: zero keys), unless
    it sets any link option itself: then the user's alone (a mix could cut the DP group in a way neither chose)."""
    if not links or any(key in zero for key in LINK_KEYS):
        return dict(zero)
    return {**links, **zero}


def planned_zero(ctx: Any) -> dict:
    """The engine's ``zero`` keys for a rank's ``hybrid.runtime.train.Context``: the model config's ``zero:`` with
    the plan's link options (``JobSettings.zero_links``: how ZeRO's collectives use the links, where the time
    model chose them)."""
    return with_plan_links(getattr(ctx.settings, "zero_links", None), zero_options(ctx.model_config.get("zero")))
