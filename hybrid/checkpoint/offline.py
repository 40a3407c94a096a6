"""Reading checkpoints offline: one process, no process group, no model object.

``consolidate(path)`` returns the single-process state dict, keyed like ``module.state_dict()``: every
trainable parameter from its fp32 master pieces (read from every DP rank into one flat tensor per TP rank,
reshaped), every frozen parameter and persistent buffer as saved (floating point ones as fp32), and every
alias of a tied tensor as the same tensor under its other name. TP slices are concatenated along the dim
recorded in the manifest (replicated tensors come from TP rank 0). ``torch.save`` of it loads with
``torch.load(weights_only=True)`` into ``model.load_state_dict`` (strict) of the single-process model.
Both verify the checkpoint's files first (``integrity``): consolidation refuses a damaged checkpoint and
a non-finite result, naming the file or tensor. ``describe(run_dir)`` lists a run's checkpoints, each
verified, for ``hybrid checkpoint inspect``.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader

from hybrid.checkpoint import integrity, layout, manifest
from hybrid.errors import CheckpointError


def consolidate(path: layout.PathLike) -> tuple[dict[str, torch.Tensor], Path, dict]:
    """``(state_dict, checkpoint_dir, manifest)`` for a run directory (its latest) or a checkpoint dir.

    Refuses (``CheckpointError``, one sentence) a checkpoint with a missing, truncated or corrupt file,
    and a result with a non-finite value, naming the file or the tensor.
    """
    ckpt = layout.resolve(path)
    inv, problems = integrity.verify(ckpt)
    if problems:
        raise integrity.CheckpointDamaged(ckpt, problems[0], integrity.FIX)
    doc = inv.manifest
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
    for name, tensor in state.items():
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise CheckpointError(f"{ckpt} holds non-finite values (NaN or inf) in {name!r}, so it is not "
                                  f"consolidated; consolidate an older checkpoint (hybrid checkpoint inspect "
                                  f"lists them).")
    for alias, name in doc["aliases"].items():
        state[alias] = state[name]
    return state, ckpt, doc


def describe(run_dir: layout.PathLike, checksums: bool = True) -> dict[str, Any]:
    """Every checkpoint directory of ``run_dir`` with its status, step, world layout and size on disk.

    Each complete one is verified (every byte read; ``checksums=False`` checks the file sizes only) and its
    status names its first problem (``corrupt: FILE``, ``truncated: FILE``, ``missing: FILE``); ``latest``
    is the newest good one, the one a resume uses.
    """
    run_dir = Path(run_dir)
    if not layout.checkpoints_dir(run_dir).is_dir():
        if layout.is_checkpoint_dir(run_dir):  # a checkpoint directory: describe its run
            return describe(run_dir.parent.parent, checksums)
        raise CheckpointError(f"{run_dir} is not a run directory (it has no {layout.CHECKPOINTS}/ directory); "
                              f"pass the job's checkpoint.dir.")
    rows, good = [], None
    for entry in layout.scan(run_dir):
        row = {"name": entry.path.name, "step": entry.step, "bytes": layout.disk_bytes(entry.path),
               "status": "writing or interrupted" if entry.temporary else "incomplete (no marker)"}
        doc = None
        sealed = entry.temporary and layout.is_complete(entry.path)  # a crash between marker and rename
        if entry.complete or sealed:
            row["status"], doc = _verified_status(entry.path, checksums)
            if row["status"].startswith("complete"):
                good = entry.path
                if sealed:  # the resume loads it too (hybrid.checkpoint.agreement)
                    row["status"] += ", sealed but not renamed (a crash before publishing)"
        if doc is None:
            try:
                doc = manifest.read(entry.path)
            except CheckpointError:
                pass
        if doc is not None:
            row.update(world=doc["world"], optimizer_step_count=doc["optimizer_step_count"],
                       saved_at=doc.get("saved_at"), parameters=sum(
                           _full_numel(spec, doc["world"]["tp"]) for section in ("params", "frozen")
                           for spec in doc[section].values()))
        rows.append(row)
    return {"run_dir": str(run_dir), "latest": good.name if good else None,
            "pointer": layout.read_pointer(run_dir), "checkpoints": rows}


def _verified_status(ckpt: Path, checksums: bool) -> tuple[str, Any]:
    """``(status, manifest or None)`` of a published checkpoint after checking its files."""
    try:
        inv = integrity.inventory(ckpt)
    except integrity.CheckpointDamaged as exc:
        return str(exc.problem), None
    except CheckpointError as exc:  # intact, but not a format this hybrid reads
        return f"unreadable: {exc}", None
    problems = integrity.check_files(ckpt, inv.files, checksums=checksums)
    if problems:
        return str(problems[0]), inv.manifest
    if not inv.checksummed:
        return f"complete ({integrity.UNVERIFIED})", inv.manifest
    return "complete" if checksums else "complete (sizes checked, checksums not read)", inv.manifest


def _full_numel(spec: dict, tp: int) -> int:
    n = 1
    for s in manifest.full_shape(spec, tp):
        n *= s
    return n
