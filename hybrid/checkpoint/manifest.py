"""``hybrid.json``: what a checkpoint holds, readable without torch, and the "same model?" check.

The manifest records the step counters, the world layout it was saved with (world size, dp, tp, ZeRO
stage, precision), the model config the caller passed, every parameter's name, TP-local shape and TP
slicing dim (None = replicated across TP), and the caller's ``extra`` state (e.g. the data position).

Tensor keys in the DCP checkpoint are ``{kind}/tp{r}/{param}`` for kind in ``master``, ``exp_avg``,
``exp_avg_sq``: one flat fp32 tensor of the parameter's TP-local numel per TP rank, written in pieces by
the DP ranks that own them. Per-rank RNG states are ``rng/rank{g}`` (pickled bytes).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Mapping, Optional

from hybrid.errors import CheckpointError
from hybrid.checkpoint.layout import MANIFEST

FORMAT = "hybrid-checkpoint"
VERSION = 1
KINDS = ("master", "exp_avg", "exp_avg_sq")


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
          params: Mapping[str, Any], model_config: Optional[Mapping[str, Any]] = None,
          extra: Optional[Mapping[str, Any]] = None) -> dict:
    manifest = {"format": FORMAT, "version": VERSION, "step": int(step),
                "optimizer_step_count": int(optimizer_step_count), "global_step": int(global_step),
                "world": dict(world), "model_config": dict(model_config) if model_config else None,
                "params": dict(params), "extra": dict(extra) if extra else {}}
    try:
        json.dumps(manifest)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"checkpoint extra state and model_config must be JSON-serializable "
                         f"(numbers, strings, lists, dicts): {exc}") from exc
    return manifest


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
    if manifest.get("version") != VERSION:
        raise CheckpointError(f"{directory} is checkpoint format version {manifest.get('version')}, but this "
                              f"hybrid reads version {VERSION}; load it with the hybrid version that wrote it.")
    return manifest


def check_same_model(manifest: Mapping[str, Any], params: Mapping[str, Any], tp: int, where: Path) -> None:
    """Raise CheckpointError unless ``params`` (this run's specs) and ``tp`` match the checkpoint's."""
    saved, saved_tp = manifest["params"], manifest["world"]["tp"]
    missing = sorted(set(params) - set(saved))
    unknown = sorted(set(saved) - set(params))
    if missing or unknown:
        name, side = (missing[0], "this model has it, the checkpoint does not") if missing else \
            (unknown[0], "the checkpoint has it, this model does not")
        raise CheckpointError(f"{where} is a checkpoint of another model: parameter {name!r} differs ({side}); "
                              f"resume with the model config it was trained with, or use a new run directory.")
    if saved_tp != tp:
        raise CheckpointError(f"{where} was saved with tensor-parallel degree tp={saved_tp} but this job runs "
                              f"tp={tp}; resume with parallel.tp: {saved_tp} (only the DP size and ZeRO stage "
                              f"may change).")
    for name, spec in params.items():
        if list(spec["shape"]) != list(saved[name]["shape"]) or spec["tp_dim"] != saved[name]["tp_dim"]:
            raise CheckpointError(f"{where} is a checkpoint of another model: parameter {name!r} has shape "
                                  f"{full_shape(saved[name], saved_tp)} there but {full_shape(spec, tp)} here; "
                                  f"resume with the model config it was trained with, or use a new run directory.")
