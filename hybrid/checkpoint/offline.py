"""Reading checkpoints offline: one process, no process group, no model object.

``consolidate(path)`` returns the single-process state dict, keyed like ``module.state_dict()``: every
trainable parameter from its fp32 master pieces (read from every DP rank into one flat tensor per TP rank,
reshaped), every frozen parameter and persistent buffer as saved (floating point ones as fp32), and every
alias of a tied tensor as the same tensor under its other name. TP slices are concatenated along the dim
recorded in the manifest (replicated tensors come from TP rank 0). ``torch.save`` of it loads with
``torch.load(weights_only=True)`` into ``model.load_state_dict`` (strict) of the single-process model.
``describe(run_dir)`` lists a run's checkpoints for ``hybrid checkpoint inspect``.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader

from hybrid.checkpoint import layout, manifest
from hybrid.errors import CheckpointError


def consolidate(path: layout.PathLike) -> tuple[dict[str, torch.Tensor], Path, dict]:
    """``(state_dict, checkpoint_dir, manifest)`` for a run directory (its latest) or a checkpoint dir."""
    ckpt = layout.resolve(path)
    doc = manifest.read(ckpt)
    tp = doc["world"]["tp"]
    reader = FileSystemReader(ckpt)
    # (manifest section, DCP key kind) for every tensor of the single-process state dict
    sections = [("params", "master")] + list(manifest.PLAIN_KINDS.items())
    parts, buffers = {}, {}  # (name, tp rank) -> DCP key, DCP key -> tensor to fill
    try:
        saved = reader.read_metadata().state_dict_metadata
        for section, kind in sections:
            for name, spec in doc[section].items():
                for r in range(tp) if spec["tp_dim"] is not None else range(1):
                    key = manifest.tensor_key(kind, r, name)
                    parts[name, r] = key
                    dtype = torch.float32 if kind == "master" else saved[key].properties.dtype
                    buffers[key] = torch.empty(saved[key].size, dtype=dtype)
        with warnings.catch_warnings():  # DCP warns that it runs without a process group: that is the point
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(buffers, storage_reader=reader, no_dist=True)
    except Exception as exc:  # a truncated or missing data file: say which checkpoint, not DCP's internals
        raise CheckpointError(f"{ckpt} is damaged and cannot be read ({type(exc).__name__}: "
                              f"{str(exc).splitlines()[0] if str(exc) else 'no detail'}); "
                              f"use an older checkpoint.") from exc
    state = {}
    for section, _ in sections:
        for name, spec in doc[section].items():
            slices = [buffers[parts[name, r]].view(spec["shape"]) for r in range(tp) if (name, r) in parts]
            full = slices[0] if len(slices) == 1 else torch.cat(slices, dim=spec["tp_dim"])
            state[name] = full.float() if full.is_floating_point() else full
    for alias, name in doc["aliases"].items():
        state[alias] = state[name]
    return state, ckpt, doc


def describe(run_dir: layout.PathLike) -> dict[str, Any]:
    """Every checkpoint directory of ``run_dir`` with its status, step, world layout and size on disk."""
    run_dir = Path(run_dir)
    if not layout.checkpoints_dir(run_dir).is_dir():
        if (run_dir / layout.MANIFEST).is_file():  # a checkpoint directory: describe its run
            return describe(run_dir.parent.parent)
        raise CheckpointError(f"{run_dir} is not a run directory (it has no {layout.CHECKPOINTS}/ directory); "
                              f"pass the job's checkpoint.dir.")
    rows = []
    for entry in layout.scan(run_dir):
        row = {"name": entry.path.name, "step": entry.step, "bytes": layout.disk_bytes(entry.path),
               "status": "complete" if entry.complete else "writing or interrupted" if entry.temporary
               else "incomplete (no marker)"}
        try:
            doc = manifest.read(entry.path)
        except CheckpointError:
            doc = None
        if doc is not None:
            row.update(world=doc["world"], optimizer_step_count=doc["optimizer_step_count"],
                       saved_at=doc.get("saved_at"), parameters=sum(
                           _full_numel(spec, doc["world"]["tp"]) for section in ("params", "frozen")
                           for spec in doc[section].values()))
        rows.append(row)
    found = layout.latest(run_dir)
    return {"run_dir": str(run_dir), "latest": found.name if found else None,
            "pointer": layout.read_pointer(run_dir), "checkpoints": rows}


def _full_numel(spec: dict, tp: int) -> int:
    n = 1
    for s in manifest.full_shape(spec, tp):
        n *= s
    return n
