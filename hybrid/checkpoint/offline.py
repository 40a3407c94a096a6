"""Reading checkpoints offline: one process, no process group, no model object.

``consolidate(path)`` returns the single-process state dict, keyed like ``module.state_dict()``: every
trainable parameter from its fp32 master pieces (read from every DP rank into one flat tensor per TP rank,
reshaped), every frozen parameter and persistent buffer as saved (floating point ones at least fp32: ``exported``), and every
alias of a tied tensor as the same tensor under its other name. TP slices are concatenated along the dim
recorded in the manifest (replicated tensors come from TP rank 0). ``torch.save`` of it loads with
``torch.load(weights_only=True)`` into ``model.load_state_dict`` (strict) of the single-process model.
Both verify the checkpoint's files first (``integrity``): consolidation refuses a damaged checkpoint and
a non-finite result, naming the file or tensor. ``describe(run_dir)`` lists a run's checkpoints, each
verified, for ``hybrid checkpoint inspect``.

The pieces ``consolidate`` is made of serve an export that streams (``hybrid.checkpoint.hf_export``):
``verified(path)`` (the checkpoint and its verified inventory), ``saved_tensors`` (what it holds, tensor by
tensor, with sizes, reading no data) and ``read_tensors`` (some of them, read and checked).
``inside_checkpoint(path)`` tells whether an output path would land inside a checkpoint.
"""

from __future__ import annotations

import functools
import math
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader

from hybrid.checkpoint import integrity, layout, manifest
from hybrid.errors import CheckpointError, first_line
from hybrid.weights.state_entries import exported


def _unreadable_said(read: Callable) -> Callable:
    """``read`` with an operating-system error (a directory it may not list, an I/O error) turned into one
    sentence naming the path: these run in the CLI, which shows a ``CheckpointError`` as its ``error:`` line."""
    @functools.wraps(read)
    def said(path, *args, **kwargs):
        try:
            return read(path, *args, **kwargs)
        except OSError as exc:
            fix = integrity.UNREADABLE_FIX if isinstance(exc, PermissionError) else integrity.FIX
            raise CheckpointError(f"cannot read {exc.filename or path} ({exc.strerror or exc}); {fix}") from None
    return said


@_unreadable_said
def consolidate(path: layout.PathLike) -> tuple[dict[str, torch.Tensor], Path, dict]:
    """``(state_dict, checkpoint_dir, manifest)`` for a checkpoint directory (under any name), or a run
    directory or its ``checkpoints/`` directory: there, the checkpoint a resume would load (``newest_good``).

    Refuses (``CheckpointError``, one sentence) a checkpoint with a missing, truncated, corrupt or
    unreadable file, and a result with a non-finite value, naming the file or the tensor.
    """
    ckpt, inv = verified(path)
    doc = inv.manifest
    reader = FileSystemReader(ckpt)
    state = read_tensors(ckpt, reader, saved_tensors(ckpt, reader, doc))
    for alias, name in doc["aliases"].items():
        state[alias] = state[name]
    return state, ckpt, doc


@_unreadable_said
def verified(path: layout.PathLike) -> tuple[Path, integrity.Inventory]:
    """The checkpoint ``path`` names (``consolidate`` says which) and its inventory, every file verified."""
    path = Path(path)
    if layout.is_checkpoint_dir(path):
        ckpt = layout.resolve(path)
        inv, problems = integrity.verify(ckpt)
        if problems:
            raise integrity.refusal(ckpt, problems[0])
        return ckpt, inv
    return newest_good(path)


@dataclass(frozen=True)
class SavedTensor:
    """One tensor of the single-process state dict as a checkpoint holds it: its DCP key on each TP rank that
    holds a piece (one key when it is replicated), the TP-local shape and the dtype it is read in."""

    name: str
    keys: tuple
    shape: tuple  # TP-local
    tp_dim: Optional[int]
    dtype: torch.dtype  # as saved (masters: fp32)
    flat: bool  # saved flattened (a master: written in pieces by the DP ranks that own them)
    empty: bool = False  # a zero-element parameter: no rank saved a piece of it

    @property
    def full_shape(self) -> tuple:
        shape = list(self.shape)
        if self.tp_dim is not None:
            shape[self.tp_dim] *= len(self.keys)
        return tuple(shape)

    @property
    def exported_dtype(self) -> torch.dtype:
        """The dtype ``consolidate`` gives it (``exported``)."""
        return torch.promote_types(self.dtype, torch.float32) if self.dtype.is_floating_point else self.dtype

    @property
    def nbytes(self) -> int:
        """Its bytes in the consolidated state dict."""
        return math.prod(self.full_shape) * self.exported_dtype.itemsize


def saved_tensors(ckpt: Path, reader: FileSystemReader, doc: dict) -> list[SavedTensor]:
    """Every tensor of the single-process state dict (each tied tensor once, under its first name), in the
    manifest's order: trainable parameters from their fp32 masters, then frozen parameters and buffers."""
    try:
        saved = reader.read_metadata().state_dict_metadata
        tp = doc["world"]["tp"]
        out = []
        # (manifest section, DCP key kind) for every tensor of the single-process state dict
        for section, kind in [("params", "master")] + list(manifest.PLAIN_KINDS.items()):
            for name, spec in doc[section].items():
                keys = tuple(manifest.tensor_key(kind, r, name)
                             for r in (range(tp) if spec["tp_dim"] is not None else range(1)))
                empty = kind == "master" and keys[0] not in saved and math.prod(spec["shape"]) == 0
                dtype = torch.float32 if kind == "master" else saved[keys[0]].properties.dtype
                out.append(SavedTensor(name, keys, tuple(spec["shape"]), spec["tp_dim"], dtype, kind == "master",
                                       empty))
        return out
    except Exception as exc:  # unreadable DCP metadata, a key the manifest names and DCP does not hold
        raise _damaged(ckpt, exc) from exc


def read_tensors(ckpt: Path, reader: FileSystemReader, tensors: list[SavedTensor]) -> dict[str, torch.Tensor]:
    """``tensors`` of checkpoint ``ckpt`` read (one DCP load for all of them), TP slices concatenated, as
    ``consolidate`` gives them; a non-finite value is one ``CheckpointError`` naming the tensor."""
    buffers = {}  # DCP key -> tensor to fill
    for t in tensors:
        if not t.empty:
            for key in t.keys:
                buffers[key] = torch.empty(math.prod(t.shape) if t.flat else t.shape, dtype=t.dtype)
    try:
        with warnings.catch_warnings():  # DCP warns that it runs without a process group: that is the point
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(buffers, storage_reader=reader, no_dist=True)
    except Exception as exc:  # a truncated or missing data file: say which checkpoint, not DCP's internals
        raise _damaged(ckpt, exc) from exc
    state = {}
    for t in tensors:
        if t.empty:
            state[t.name] = torch.empty(t.shape, dtype=torch.float32)
            continue
        slices = [buffers.pop(key).view(t.shape) for key in t.keys]
        full = exported(slices[0] if len(slices) == 1 else torch.cat(slices, dim=t.tp_dim))
        if full.is_floating_point() and not _all_finite(full):
            raise CheckpointError(f"{ckpt} holds non-finite values (NaN or inf) in {t.name!r}, so it is not "
                                  f"consolidated; consolidate an older checkpoint (hybrid checkpoint inspect "
                                  f"lists them).")
        state[t.name] = full
    return state


def _all_finite(tensor: torch.Tensor, chunk: int = 1 << 20) -> bool:
    """No NaN or inf in ``tensor``, checked a chunk at a time (``isfinite`` of the whole tensor would hold
    temporaries as large as it: its ``abs()`` and a bool mask)."""
    return all(bool(torch.isfinite(part).all()) for part in tensor.reshape(-1).split(chunk))


def _damaged(ckpt: Path, exc: Exception) -> CheckpointError:
    return CheckpointError(f"{ckpt} is damaged and cannot be read ({type(exc).__name__}: {first_line(exc)}); "
                           f"use an older checkpoint.")


def inside_checkpoint(path: layout.PathLike) -> Optional[Path]:
    """The checkpoint directory, or run's ``checkpoints/`` directory, that ``path`` lies in (symlinks followed),
    None when it lies outside every one: writing there would overwrite a checkpoint's file, or add one that
    makes it fail verification."""
    where = Path(path).resolve()
    for parent in (where, *where.parents):
        if layout.is_checkpoint_dir(parent) or _holds_checkpoints(parent):
            return parent
    return None


def _holds_checkpoints(path: Path) -> bool:
    """A run's ``checkpoints/`` directory (not any directory of that name): it holds checkpoints or ``latest``."""
    return path.name == layout.CHECKPOINTS and path.is_dir() and bool(
        layout.scan(path.parent) or (path / layout.POINTER).exists())


@dataclass(frozen=True)
class Verdict:
    """What verifying one checkpoint directory found: its inventory (None when the marker or manifest is
    damaged), its first problem (None: good), or the error of an intact directory this hybrid cannot read."""

    inventory: Optional[integrity.Inventory]
    problem: Optional[integrity.Problem] = None
    error: Optional[CheckpointError] = None

    @property
    def good(self) -> bool:
        return self.inventory is not None and self.problem is None and self.error is None

    @property
    def stops_resume(self) -> bool:
        """A resume refuses here rather than skip (a file it may not read, another format)."""
        return self.error is not None or (self.problem is not None and self.problem.kind == integrity.UNREADABLE)


def verdict(ckpt: Path, checksums: bool = True) -> Verdict:
    """Verify ``ckpt`` in this process (``checksums=False``: file sizes only)."""
    try:
        inv = integrity.inventory(ckpt)
    except integrity.CheckpointDamaged as exc:
        return Verdict(None, exc.problem)
    except CheckpointError as exc:  # intact, but not a format this hybrid reads
        return Verdict(None, error=exc)
    problems = integrity.check_files(ckpt, inv.files, checksums=checksums)
    return Verdict(inv, problems[0] if problems else None)


def resume_choice(entries: list, verdict_of: Callable[[layout.Entry], Verdict]) -> tuple:
    """``(entry, its verdict)`` a resume loads from ``entries`` (``layout.candidates``: newest first), as
    ``agreement.choose`` decides on the ranks: a bad one is skipped, one that stops a resume ends the walk
    with ``(that entry, its verdict)`` too; ``(None, None)`` when none is good. ``verdict_of`` is called on
    each entry in turn until the answer is known."""
    for entry in entries:
        found = verdict_of(entry)
        if found.good or found.stops_resume:
            return entry, found
    return None, None


def _damaged(entries: list) -> list:
    """When a resume finds no good checkpoint among ``entries``: the ones that make it stop rather than start
    fresh (every one but the saves that never finished, as ``agreement.choose`` counts them)."""
    return [e for e in entries if not e.interrupted]


def newest_good(path: layout.PathLike) -> tuple[Path, integrity.Inventory]:
    """The checkpoint a resume would load from the run directory ``path`` (or its ``checkpoints/``): the
    newest verified one, sealed temporaries included; ``CheckpointError`` when there is none, or when the
    resume would stop (a file it may not read)."""
    path = Path(path)
    run_dir = layout.run_dir_of(path)
    if not path.exists():
        layout.resolve(path)  # raises: it does not exist
    if not layout.checkpoints_dir(run_dir).is_dir():
        raise layout.not_a_checkpoint(path)
    entries = layout.candidates(run_dir)
    entry, found = resume_choice(entries, lambda e: verdict(e.path))
    if entry is None:
        damaged = _damaged(entries)
        if not damaged:
            raise layout.no_checkpoint(run_dir)
        raise CheckpointError(f"no checkpoint in {layout.checkpoints_dir(run_dir)} is good ({len(damaged)} "
                              f"damaged: hybrid checkpoint inspect {run_dir} names their problems); restore "
                              f"one from a backup.")
    if found.error is not None:
        raise found.error
    if found.problem is not None:
        raise integrity.refusal(entry.path, found.problem)
    return entry.path, found.inventory


@_unreadable_said
def describe(run_dir: layout.PathLike, checksums: bool = True) -> dict[str, Any]:
    """Every checkpoint directory of ``run_dir`` (a run directory, its ``checkpoints/`` directory, or one
    checkpoint directory under any name) with its status, step, world layout and size on disk.

    Each complete one is verified (every byte read; ``checksums=False`` checks the file sizes only) and its
    status names its first problem (``corrupt: FILE``, ``truncated: FILE``, ``missing: FILE``,
    ``unreadable: FILE``); ``latest`` is the one a resume uses (``resume_choice``), None when none is good
    or the resume stops (``resume_stops`` then says why).
    """
    path = Path(run_dir)
    if layout.is_checkpoint_dir(path) and path.parent.name != layout.CHECKPOINTS:
        return _describe_one(path, checksums)
    if layout.is_checkpoint_dir(path):  # a step directory: describe its run
        path = path.parent.parent
    run_dir = layout.run_dir_of(path)
    if not layout.checkpoints_dir(run_dir).is_dir():
        raise CheckpointError(f"{run_dir} is not a run directory (it has no {layout.CHECKPOINTS}/ directory); "
                              f"pass the job's checkpoint.dir.")
    entries = layout.scan(run_dir)
    verdicts = {e.path: verdict(e.path, checksums) for e in entries if e.complete or e.sealed}
    chosen, found = resume_choice(list(reversed(entries)), lambda e: verdicts.get(e.path, Verdict(None)))
    rows = [_row(e.path, e.step, verdicts.get(e.path), e, checksums) for e in entries]
    stops = found is not None and found.stops_resume
    reason = _stop_reason(chosen.path, found) if stops else None
    damaged = _damaged(entries)
    if chosen is None and damaged:  # as agreement.choose: checkpoints exist, none is good
        reason = (f"no good checkpoint ({len(damaged)} damaged), and starting fresh would overwrite them; move "
                  f"{layout.checkpoints_dir(run_dir)} aside to start from step 0")
    return {"run_dir": str(run_dir), "latest": chosen.path.name if chosen and not stops else None,
            "resume_stops": reason, "pointer": layout.read_pointer(run_dir), "checkpoints": rows}


def _describe_one(ckpt: Path, checksums: bool) -> dict[str, Any]:
    """``describe`` of a lone checkpoint directory (moved, renamed or symlinked out of its run)."""
    found = verdict(ckpt, checksums) if layout.is_complete(ckpt) else None
    row = _row(ckpt, None, found, None, checksums)
    return {"run_dir": str(ckpt), "latest": ckpt.name if found is not None and found.good else None,
            "resume_stops": None, "pointer": None, "checkpoints": [row]}


def _row(ckpt: Path, step: Optional[int], found: Optional[Verdict], entry: Optional[layout.Entry],
         checksums: bool) -> dict:
    """One checkpoint's row: name, step, status, size, and what its manifest says."""
    if found is None:
        status = "writing or interrupted" if entry is None or entry.temporary else "incomplete (no marker)"
    else:
        status = _status(found, checksums)
        if found.good and entry is not None and entry.sealed:  # the resume loads it too
            status += ", sealed but not renamed (a crash before publishing)"
    doc = found.inventory.manifest if found is not None and found.inventory is not None else None
    if doc is None:
        try:
            doc = manifest.read(ckpt)
        except CheckpointError:
            pass
    row = {"name": ckpt.name, "step": step if step is not None else (doc or {}).get("step"),
           "bytes": layout.disk_bytes(ckpt), "status": status}
    if doc is not None:
        row.update(_manifest_fields(doc))
    return row


def _manifest_fields(doc: dict) -> dict:
    """What a row shows of a manifest; nothing of one that lacks those fields (a damaged checkpoint's manifest,
    read unverified, may hold anything)."""
    try:
        world = dict(doc["world"])
        [world[k] for k in ("dp", "tp", "stage", "precision")]  # what the table shows of it
        return {"world": world, "optimizer_step_count": int(doc["optimizer_step_count"]),
                "saved_at": doc.get("saved_at"), "parameters": sum(
                    _full_numel(spec, doc["world"]["tp"]) for section in ("params", "frozen")
                    for spec in doc[section].values())}
    except (KeyError, TypeError, ValueError, AttributeError):
        return {}


def _status(found: Verdict, checksums: bool) -> str:
    if found.error is not None:
        return f"unreadable: {found.error}"
    if found.problem is not None:
        return str(found.problem)
    if not found.inventory.checksummed:
        return f"complete ({integrity.UNVERIFIED})"
    return "complete" if checksums else "complete (sizes checked, checksums not read)"


def _stop_reason(ckpt: Path, found: Verdict) -> str:
    return str(found.error if found.error is not None else integrity.refusal(ckpt, found.problem))


def _full_numel(spec: dict, tp: int) -> int:
    n = 1
    for s in manifest.full_shape(spec, tp):
        n *= s
    return n
