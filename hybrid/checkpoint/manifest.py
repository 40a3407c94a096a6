"""``hybrid.json``: what a checkpoint holds, readable without torch, and the "same model?" check.

The manifest records the step counters, the world layout it was saved with (world size, dp, tp, ZeRO
stage, precision), the model config the caller passed, the TP-local shape and TP slicing dim (None =
replicated across TP) of every trainable parameter (``params``), frozen parameter (``frozen``,
requires_grad=False) and persistent buffer (``buffers``) under its first name in ``module.state_dict()``,
every other name of a tied tensor (``aliases``: alias -> that first name), the caller's ``extra``
state (e.g. the data position) and, from format 3 on, the size and crc32 of every file DCP wrote
(``files``, see ``hybrid.checkpoint.integrity``; format 2 checkpoints, which have none, still load).

Tensor keys in the DCP checkpoint are ``{kind}/tp{r}/{name}``:

* ``master`` and each optimizer state key (``exp_avg``, ``exp_avg_sq`` for Adam(W), ``momentum_buffer`` for
  SGD: the manifest's ``optimizer.state``; checkpoints without that entry hold Adam's) (trainable
  parameters): one flat fp32 tensor of the parameter's TP-local numel per TP rank, written in pieces by
  the DP ranks that own them;
* ``frozen``, ``buffer``: the TP-local tensor as the module holds it (its shape and dtype), written by
  DP rank 0 of each TP rank (they are DP-replicated).

Per-rank RNG states are ``rng/rank{g}`` (pickled bytes).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Mapping, Optional

from hybrid.errors import CheckpointError, UsageError
from hybrid.checkpoint.layout import MANIFEST

FORMAT = "hybrid-checkpoint"
VERSION = 3  # 2: frozen parameters, buffers and tied aliases; 3: per-file checksums, a sealed marker
READABLE = (2, 3)
KINDS = ("master", "exp_avg", "exp_avg_sq")
FROZEN, BUFFER = "frozen", "buffer"
# manifest section -> what an error message calls its entries
SECTIONS = {"params": "parameter", "frozen": "frozen parameter", "buffers": "buffer"}
# manifest section of DP-replicated tensors -> their DCP key kind
PLAIN_KINDS = {"frozen": FROZEN, "buffers": BUFFER}


def tensor_key(kind: str, tp_rank: int, name: str) -> str:
    return f"{kind}/tp{tp_rank}/{name}"


def rng_key(rank: int) -> str:
    return f"rng/rank{rank}"


def param_specs(shapes: Mapping[str, Any], tp_dims: Mapping[str, Optional[int]]) -> dict:
    """``{name: {"shape": [...], "tp_dim": int | None}}`` in name order."""
    return {name: {"shape": [int(s) for s in shapes[name]], "tp_dim": tp_dims.get(name)}
            for name in sorted(shapes)}


def full_shape(spec: Mapping[str, Any], tp: int) -> list[int]:
    """The single-process shape of a parameter from its TP-local spec."""
    shape = list(spec["shape"])
    if spec["tp_dim"] is not None:
        shape[spec["tp_dim"]] *= tp
    return shape


def numel(spec: Mapping[str, Any]) -> int:
    return math.prod(spec["shape"])


def build(*, step: int, optimizer_step_count: int, global_step: int, world: Mapping[str, Any],
          params: Mapping[str, Any], frozen: Optional[Mapping[str, Any]] = None,
          buffers: Optional[Mapping[str, Any]] = None, aliases: Optional[Mapping[str, str]] = None,
          model_config: Optional[Mapping[str, Any]] = None, extra: Optional[Mapping[str, Any]] = None,
          optimizer: Optional[Mapping[str, Any]] = None) -> dict:
    manifest = {"format": FORMAT, "version": VERSION, "step": int(step),
                "optimizer_step_count": int(optimizer_step_count), "global_step": int(global_step),
                "world": dict(world), "model_config": dict(model_config) if model_config else None,
                "params": dict(params), "frozen": dict(frozen or {}), "buffers": dict(buffers or {}),
                "aliases": dict(sorted((aliases or {}).items())), "extra": dict(extra) if extra else {}}
    if optimizer is not None:
        manifest["optimizer"] = dict(optimizer)
    check_extra(manifest["extra"])
    try:
        json.dumps(manifest, sort_keys=True)  # as ``write`` will: mixed key types fail here, on every rank
    except (TypeError, ValueError) as exc:
        raise ValueError(f"checkpoint extra state and model_config must be JSON-serializable "
                         f"(numbers, strings, lists, dicts): {exc}") from exc
    return manifest


def check_extra(value: Any, where: str = "client_state") -> None:
    """``UsageError`` (one sentence naming the entry) unless ``value`` comes back from the manifest's JSON as it
    went in: dicts with string keys, lists, strings, finite-or-not floats, ints, bools, None. A tensor, a tuple
    (it would come back a list) or an int key (it would come back a string) is refused, not changed."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return
    if isinstance(value, list):
        for i, item in enumerate(value):
            check_extra(item, f"{where}[{i}]")
        return
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                raise UsageError(f"{where} has the key {key!r} (of type {type(key).__name__}): a checkpoint keeps its "
                                 "extra state as JSON, whose keys are strings; use string keys.")
            check_extra(item, f"{where}[{key!r}]")
        return
    fix = " (tensor.tolist(), or .item() for one value)" if hasattr(value, "tolist") else \
        " (a list for a tuple)" if isinstance(value, tuple) else ""
    raise UsageError(f"{where} is of type {type(value).__name__}: a checkpoint keeps its extra state as JSON values "
                     f"(numbers, strings, lists, dicts with string keys), which come back as they went in; "
                     f"convert it{fix}.")


def write(directory: Path, manifest: Mapping[str, Any]) -> None:
    with open(directory / MANIFEST, "w") as f:
        json.dump(manifest, f, indent=1, sort_keys=True)
        f.write("\n")


def read(directory: Path) -> dict:
    """The manifest of a checkpoint directory; CheckpointError when it is missing or not ours."""
    path = Path(directory) / MANIFEST
    try:
        manifest = json.loads(path.read_text())
    except OSError:
        raise CheckpointError(f"{directory} is not a hybrid checkpoint (it has no {MANIFEST}); pass a run "
                              f"directory or one of its checkpoints/step-NNNNNN directories.") from None
    except ValueError:
        raise CheckpointError(f"{path} is not valid JSON, so {directory} is a damaged checkpoint; "
                              f"resume from an older one or delete it.") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(f"{path} is not a hybrid checkpoint manifest; pass a run directory or one of "
                              f"its checkpoints/step-NNNNNN directories.")
    if manifest.get("version") not in READABLE:
        raise CheckpointError(f"{directory} is checkpoint format version {manifest.get('version')}, but this "
                              f"hybrid reads versions {READABLE[0]}-{READABLE[-1]}; load it with the hybrid "
                              f"version that wrote it.")
    return manifest


def check_same_model_config(manifest: Mapping[str, Any], model_config: Optional[Mapping[str, Any]],
                            where: Path) -> None:
    """Raise CheckpointError unless the ``model:`` section of this run's model config is the checkpoint's
    (when both have one): equal parameter shapes can hold another architecture (another head count). The
    rest of the config (``train:``, ``data:``) may change at a resume."""
    saved = (manifest.get("model_config") or {}).get("model")
    mine = (model_config or {}).get("model")
    if not isinstance(saved, Mapping) or not isinstance(mine, Mapping):
        return
    mine = json.loads(json.dumps(mine, default=str))  # as the manifest stored it
    unset = object()
    diffs = [k for k in sorted(set(saved) | set(mine)) if saved.get(k, unset) != mine.get(k, unset)]
    if diffs:
        shown = ", ".join(f"model.{k} is {mine.get(k, 'unset')!r} here but was {saved.get(k, 'unset')!r}"
                          for k in diffs[:3])
        raise CheckpointError(f"{where} is a checkpoint of another model: {shown}; resume with the model config "
                              f"it was trained with, or use a new run directory.")


def check_same_model(manifest: Mapping[str, Any], params: Mapping[str, Any], tp: int, where: Path,
                     frozen: Optional[Mapping[str, Any]] = None, buffers: Optional[Mapping[str, Any]] = None) -> None:
    """Raise CheckpointError unless this run's specs (trainable ``params``, ``frozen`` parameters,
    ``buffers``) and ``tp`` match the checkpoint's."""
    here = {"params": params, "frozen": frozen or {}, "buffers": buffers or {}}
    kind_here = {name: section for section, specs in here.items() for name in specs}
    kind_saved = {name: section for section in SECTIONS for name in manifest[section]}
    for name in sorted(set(kind_here) | set(kind_saved)):
        mine, theirs = kind_here.get(name), kind_saved.get(name)
        if mine is None or theirs is None:
            what, side = (SECTIONS[mine], "this model has it, the checkpoint does not") if theirs is None else \
                (SECTIONS[theirs], "the checkpoint has it, this model does not")
            raise CheckpointError(f"{where} is a checkpoint of another model: {what} {name!r} differs ({side}); "
                                  f"resume with the model config it was trained with, or use a new run directory.")
        if mine != theirs:
            raise CheckpointError(f"{where} holds {name!r} as a {SECTIONS[theirs]} but this model has it as a "
                                  f"{SECTIONS[mine]}; resume with the requires_grad settings it was trained with, "
                                  f"or use a new run directory.")
    saved_tp = manifest["world"]["tp"]
    if saved_tp != tp:
        raise CheckpointError(f"{where} was saved with tensor-parallel degree tp={saved_tp} but this job runs "
                              f"tp={tp}; resume with parallel.tp: {saved_tp} on nodes of at least {saved_tp} GPUs "
                              f"(only the DP size and ZeRO stage may change), or use a new run directory.")
    for section, specs in here.items():
        for name, spec in specs.items():
            saved = manifest[section][name]
            if list(spec["shape"]) != list(saved["shape"]) or spec["tp_dim"] != saved["tp_dim"]:
                raise CheckpointError(f"{where} is a checkpoint of another model: {SECTIONS[section]} {name!r} has "
                                      f"shape {full_shape(saved, saved_tp)} there but {full_shape(spec, tp)} here; "
                                      f"resume with the model config it was trained with, or use a new run "
                                      f"directory.")


def check_same_optimizer(manifest: Mapping[str, Any], here: Mapping[str, Any], where: Path) -> None:
    """Raise CheckpointError when the checkpoint's optimizer class or state keys differ from this run's (a
    checkpoint without an ``optimizer`` entry holds AdamW's). Hyper-parameters (lr, betas, ...) may change."""
    saved = manifest.get("optimizer") or {"type": "AdamW", "state": list(KINDS[1:])}
    if saved["type"] != here["type"]:
        form = " (in DeepSpeed's form with adam_w_mode: false)" if saved["type"] == "Adam" else ""
        raise CheckpointError(f"{where} was saved with optimizer {saved['type']} but this run uses {here['type']}; "
                              f"resume with optimizer.type: {saved['type']}{form}, or use a new run directory.")
    if list(saved["state"]) != list(here["state"]):
        raise CheckpointError(f"{where} was saved with {saved['type']} holding state "
                              f"{', '.join(saved['state']) or 'none'} but this run's {here['type']} holds "
                              f"{', '.join(here['state']) or 'none'} (an option such as amsgrad differs); resume with "
                              f"the optimizer options it was trained with, or use a new run directory.")
