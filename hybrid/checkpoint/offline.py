"""Reading checkpoints offline: one process, no process group, no model object.

``consolidate(path)`` returns the single-process fp32 state dict (parameter name → full tensor): every
master piece of every DP rank is read into one flat tensor per parameter and TP rank, reshaped, and the TP
slices are concatenated along the dim recorded in the manifest (replicated parameters come from TP rank 0).
``torch.save`` of it loads with ``torch.load(weights_only=True)`` into ``model.load_state_dict`` of the
single-process model. ``describe(run_dir)`` lists a run's checkpoints for ``hybrid checkpoint inspect``.
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
    tp, params = doc["world"]["tp"], doc["params"]
    ranks = {name: range(tp) if spec["tp_dim"] is not None else range(1) for name, spec in params.items()}
    flat = {manifest.tensor_key("master", r, name): torch.empty(manifest.numel(spec), dtype=torch.float32)
            for name, spec in params.items() for r in ranks[name]}
    try:
        with warnings.catch_warnings():  # DCP warns that it runs without a process group: that is the point
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(flat, storage_reader=FileSystemReader(ckpt), no_dist=True)
    except Exception as exc:  # a truncated or missing data file: say which checkpoint, not DCP's internals
        raise CheckpointError(f"{ckpt} is damaged and cannot be read ({type(exc).__name__}: "
                              f"{str(exc).splitlines()[0] if str(exc) else 'no detail'}); "
                              f"use an older checkpoint.") from exc
    state = {}
    for name, spec in params.items():
        slices = [flat[manifest.tensor_key("master", r, name)].view(spec["shape"]) for r in ranks[name]]
        state[name] = slices[0] if len(slices) == 1 else torch.cat(slices, dim=spec["tp_dim"])
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
                           _full_numel(spec, doc["world"]["tp"]) for spec in doc["params"].values()))
        rows.append(row)
    found = layout.latest(run_dir)
    return {"run_dir": str(run_dir), "latest": found.name if found else None,
            "pointer": layout.read_pointer(run_dir), "checkpoints": rows}


def _full_numel(spec: dict, tp: int) -> int:
    n = 1
    for s in manifest.full_shape(spec, tp):
        n *= s
    return n
