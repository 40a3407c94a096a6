"""Where checkpoints live on disk, and the atomic publish protocol (no torch, no process group).

A run directory holds ``checkpoints/``; each checkpoint is one directory in it::

    RUN_DIR/checkpoints/
        step-000010/          a complete checkpoint: DCP files, .metadata, hybrid.json, COMPLETE
        step-000020/
        .tmp-step-000030/     being written (or left behind by a crash): loaded only if sealed (COMPLETE
                              written, the crash came before the rename)
        latest                "step-000020": the newest published checkpoint, replaced atomically

A checkpoint is written under ``.tmp-step-NNNNNN``; only when every rank has finished, rank 0 writes the
``COMPLETE`` marker, renames the directory to ``step-NNNNNN`` and replaces ``latest`` (write a temporary
file, then ``os.replace``). A directory without its marker is never loaded, whatever its name, so a crash
at any point leaves the previous good checkpoint in charge. ``latest(run_dir)`` is the complete checkpoint
with the highest step; the pointer file is what a human or another tool reads, and is verified, not trusted.
"Complete" means published with its marker; whether its files are intact is ``integrity``'s question (the
marker seals the manifest, the manifest lists every file's checksum).
"""

from __future__ import annotations

import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Union

from hybrid.errors import CheckpointError

PathLike = Union[str, os.PathLike]

CHECKPOINTS = "checkpoints"
MARKER = "COMPLETE"
MANIFEST = "hybrid.json"
DCP_METADATA = ".metadata"
POINTER = "latest"
_TMP_PREFIX = ".tmp-"
_STEP_RE = re.compile(r"^(\.tmp-)?step-(\d+)$")


@dataclass(frozen=True)
class Entry:
    """One checkpoint directory: its step, and whether it is complete (published with its marker)."""

    path: Path
    step: int
    complete: bool
    temporary: bool  # still under its .tmp- name: being written, or abandoned by a crash


def step_name(step: int) -> str:
    return f"step-{int(step):06d}"


def step_of(path: PathLike) -> int:
    """The step in a checkpoint directory's name (``step-000010`` or ``.tmp-step-000010``)."""
    match = _STEP_RE.match(Path(path).name)
    if match is None:
        raise ValueError(f"{path} is not named like a checkpoint directory")
    return int(match.group(2))


def checkpoints_dir(run_dir: PathLike) -> Path:
    return Path(run_dir) / CHECKPOINTS


def temporary_dir(run_dir: PathLike, step: int) -> Path:
    return checkpoints_dir(run_dir) / (_TMP_PREFIX + step_name(step))


def final_dir(run_dir: PathLike, step: int) -> Path:
    return checkpoints_dir(run_dir) / step_name(step)


def is_complete(path: PathLike) -> bool:
    """True for a published checkpoint: its marker is present (a missing manifest or DCP metadata behind
    it is damage, which ``integrity`` names)."""
    return (Path(path) / MARKER).is_file()


def scan(run_dir: PathLike) -> list[Entry]:
    """Every checkpoint directory under ``run_dir`` (complete or not), oldest step first."""
    root = checkpoints_dir(run_dir)
    if not root.is_dir():
        return []
    entries = []
    for child in root.iterdir():
        match = _STEP_RE.match(child.name)
        if match and child.is_dir():
            temporary = match.group(1) is not None
            entries.append(Entry(child, int(match.group(2)), not temporary and is_complete(child), temporary))
    return sorted(entries, key=lambda e: (e.step, e.temporary, e.path.name))


def latest(run_dir: PathLike) -> Optional[Path]:
    """The newest complete checkpoint of ``run_dir``, or None when it has none."""
    complete = [e for e in scan(run_dir) if e.complete]
    return complete[-1].path if complete else None


def resolve(path: PathLike) -> Path:
    """A complete checkpoint directory from a run directory (its latest) or a checkpoint directory itself.

    Raises CheckpointError with one sentence when ``path`` is neither.
    """
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"{path} does not exist; pass a run directory or one of its "
                              f"{CHECKPOINTS}/step-NNNNNN directories.")
    if is_checkpoint_dir(path):
        if not is_complete(path):
            raise CheckpointError(f"{path} is an incomplete checkpoint (no {MARKER} marker: its save was "
                                  f"interrupted); pass the run directory to use its latest complete checkpoint.")
        return path
    run_dir = run_dir_of(path)
    if path.is_dir() and checkpoints_dir(run_dir).is_dir():
        found = latest(run_dir)
        if found is None:
            raise CheckpointError(f"{run_dir} has no complete checkpoint in {CHECKPOINTS}/; "
                                  f"train with a checkpoint cadence (job.checkpoint.every) first.")
        return found
    raise CheckpointError(f"{path} is not a hybrid checkpoint (no {MANIFEST} and no {CHECKPOINTS}/ directory); "
                          f"pass a run directory or one of its {CHECKPOINTS}/step-NNNNNN directories.")


def run_dir_of(path: PathLike) -> Path:
    """The run directory a path names: itself, or the parent of its ``checkpoints/`` directory."""
    path = Path(path)
    return path.parent if path.name == CHECKPOINTS else path


def is_checkpoint_dir(path: PathLike) -> bool:
    """True when ``path`` is one checkpoint directory (named like one, holding its marker or manifest)."""
    path = Path(path)
    named = path.is_dir() and bool(_STEP_RE.match(path.name))
    return named and any((path / n).exists() for n in (MANIFEST, MARKER))


def publish(tmp: Path, final: Path, marker: Optional[str] = None) -> None:
    """Mark ``tmp`` complete (the marker holds ``marker``, by default the checkpoint's name), rename it to
    ``final`` and point ``latest`` at it (rank 0, after all wrote).

    Each step is durable before the next: the marker is fsynced before the rename, the rename before the
    pointer. A complete checkpoint already at ``final`` (the same step saved again) is replaced only after
    the new one is in place under its temporary name.
    """
    _write_durably(tmp / MARKER, marker if marker is not None else final.name + "\n")
    _fsync_dir(tmp)
    old = None
    if final.exists():
        old = final.with_name(_TMP_PREFIX + "old-" + final.name)
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
    os.replace(tmp, final)
    _fsync_dir(final.parent)
    write_pointer(final.parent, final.name)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def write_pointer(root: Path, name: str) -> None:
    """Atomically replace ``root/latest`` with ``name``."""
    tmp = root / f".{POINTER}.tmp-{os.getpid()}"
    _write_durably(tmp, name + "\n")
    os.replace(tmp, root / POINTER)
    _fsync_dir(root)


def read_pointer(run_dir: PathLike) -> Optional[str]:
    try:
        return (checkpoints_dir(run_dir) / POINTER).read_text().strip() or None
    except OSError:
        return None


def prune(run_dir: PathLike, keep_last: Optional[int], keep: Optional[Path] = None) -> list[Path]:
    """Delete all but the ``keep_last`` newest complete checkpoints, and every abandoned temporary directory
    except ``keep``; returns what was removed. ``keep_last`` None or < 1 keeps every complete checkpoint.
    Published directories without a marker are left for a human to look at (``hybrid checkpoint inspect``).
    """
    entries = scan(run_dir)
    doomed = [e.path for e in entries if e.temporary and e.path != keep]
    complete = [e for e in entries if e.complete]
    if keep_last is not None and keep_last >= 1:
        doomed += [e.path for e in complete[:-keep_last] if e.path != keep]
    for path in doomed:
        shutil.rmtree(path, ignore_errors=True)
    return doomed


def disk_bytes(path: PathLike) -> int:
    """Total size of the files under ``path``."""
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


def _write_durably(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # some filesystems cannot open a directory; the rename is still atomic there
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
