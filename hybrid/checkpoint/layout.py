"""Where checkpoints live on disk, and the atomic publish protocol (no torch, no process group).

A run directory holds ``checkpoints/``; each checkpoint is one directory in it::

    RUN_DIR/checkpoints/
        step-000010/          a complete checkpoint: DCP files, .metadata, hybrid.json, COMPLETE
        step-000020/
        .tmp-step-000030/     being written (or left behind by a crash): loaded only if sealed (COMPLETE
                              written, the crash came before the rename)
        latest                "step-000020": the newest published checkpoint, replaced atomically
        .lock                 held (``fcntl.flock``) by the one job that writes here (``hybrid.checkpoint.lock``)

A checkpoint is written under ``.tmp-step-NNNNNN``; only when every rank has finished, rank 0 writes the
``COMPLETE`` marker, renames the directory to ``step-NNNNNN`` and replaces ``latest`` (write a temporary
file, then ``os.replace``). A directory without its marker is never loaded, whatever its name, so a crash
at any point leaves the previous good checkpoint in charge. ``latest(run_dir)`` is the complete checkpoint
with the highest step; the pointer file is what a human or another tool reads, and is verified, not trusted
(failing to write it is a warning, never a failed save).
"Complete" means published with its marker; whether its files are intact is ``integrity``'s question (the
marker seals the manifest, the manifest lists every file's checksum).
"""

from __future__ import annotations

import logging
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Union

from hybrid.errors import CheckpointError

PathLike = Union[str, os.PathLike]
log = logging.getLogger(__name__)

CHECKPOINTS = "checkpoints"
MARKER = "COMPLETE"
MANIFEST = "hybrid.json"
DCP_METADATA = ".metadata"
POINTER = "latest"
_TMP_PREFIX = ".tmp-"
_OLD_PREFIX = _TMP_PREFIX + "old-"  # publish's earlier copy of a step saved again, while it is replaced
_STEP_RE = re.compile(r"^(\.tmp-)?step-(\d+)$")


@dataclass(frozen=True)
class Entry:
    """One checkpoint directory: its step, and whether it is complete (published with its marker)."""

    path: Path
    step: int
    complete: bool
    temporary: bool  # still under its .tmp- name: being written, or abandoned by a crash

    @property
    def sealed(self) -> bool:
        """A temporary directory with its marker: the crash came between marker and rename, so it is a
        checkpoint that a resume loads (and pruning keeps)."""
        return self.temporary and is_complete(self.path)

    @property
    def interrupted(self) -> bool:
        """A temporary directory without its marker: a save that never finished, never a checkpoint."""
        return self.temporary and not self.sealed


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
    it is damage, which ``integrity`` names). A directory this user may not search counts as published:
    verifying it then names the file it cannot read, where calling it unfinished would let a resume pass
    it over (or prune it) without a word."""
    try:
        return (Path(path) / MARKER).is_file()
    except PermissionError:
        return True


def scan(run_dir: PathLike) -> list[Entry]:
    """Every checkpoint directory under ``run_dir`` (complete or not), oldest step first. A ``checkpoints/``
    directory this user may not list is one sentence (``CheckpointError``)."""
    root = checkpoints_dir(run_dir)
    try:
        if not root.is_dir():
            return []
        children = list(root.iterdir())
    except PermissionError:
        raise CheckpointError(f"cannot list {root} (permission denied), so its checkpoints cannot be read; make "
                              f"it readable by the user that runs hybrid (chmod u+rx), then run again.") from None
    entries = []
    for child in children:
        match = _STEP_RE.match(child.name)
        if match and child.is_dir():
            temporary = match.group(1) is not None
            entries.append(Entry(child, int(match.group(2)), not temporary and is_complete(child), temporary))
    return sorted(entries, key=lambda e: (e.step, e.temporary, e.path.name))


def candidates(run_dir: PathLike) -> list[Entry]:
    """Every checkpoint directory of ``run_dir`` in the order a resume tries them: the newest step first
    (for one step, its temporary directory before its published one)."""
    return list(reversed(scan(run_dir)))


def latest(run_dir: PathLike) -> Optional[Path]:
    """The newest complete checkpoint of ``run_dir``, or None when it has none."""
    complete = [e for e in scan(run_dir) if e.complete]
    return complete[-1].path if complete else None


def resolve(path: PathLike) -> Path:
    """A complete checkpoint directory from a run directory (its latest complete one), its ``checkpoints/``
    directory, or a checkpoint directory itself (under any name: moved, renamed or symlinked).

    Raises CheckpointError with one sentence when ``path`` is none of these.
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
            raise no_checkpoint(run_dir)
        return found
    raise not_a_checkpoint(path)


def no_checkpoint(run_dir: PathLike) -> CheckpointError:
    return CheckpointError(f"{run_dir} has no complete checkpoint in {CHECKPOINTS}/; "
                           f"train with a checkpoint cadence (job.checkpoint.every) first.")


def not_a_checkpoint(path: PathLike) -> CheckpointError:
    return CheckpointError(f"{path} is not a hybrid checkpoint (no {MANIFEST} and no {CHECKPOINTS}/ directory); "
                           f"pass a run directory or one of its {CHECKPOINTS}/step-NNNNNN directories.")


def run_dir_of(path: PathLike) -> Path:
    """The run directory a path names: itself, or the parent of its ``checkpoints/`` directory."""
    path = Path(path)
    return path.parent if path.name == CHECKPOINTS else path


def is_checkpoint_dir(path: PathLike) -> bool:
    """True when ``path`` is one checkpoint directory, whatever its name (a ``step-N`` directory, or one
    moved, renamed or symlinked elsewhere): a directory holding a checkpoint's marker or manifest."""
    path = Path(path)
    return path.is_dir() and any((path / n).exists() for n in (MANIFEST, MARKER))


def layout_problem(run_dir: PathLike) -> Optional[str]:
    """Why checkpoints cannot be written under ``run_dir`` as laid out now, in words that end a sentence
    naming the path and the fix; None when nothing is in the way (missing directories are created)."""
    root = checkpoints_dir(run_dir)
    if os.path.lexists(root) and not root.is_dir():
        return f"{root} is a file, not a directory; move it aside so checkpoints can be written there"
    pointer = root / POINTER
    if pointer.is_dir():
        return f"{pointer} is a directory, but hybrid writes its latest-checkpoint pointer file there; move it aside"
    return None


def publish(tmp: Path, final: Path, marker: Optional[str] = None) -> None:
    """Mark ``tmp`` complete (the marker holds ``marker``, by default the checkpoint's name), rename it to
    ``final`` and point ``latest`` at it (rank 0, after all wrote).

    Each step is durable before the next: the marker is fsynced before the rename, the rename before the
    pointer. Whatever is at ``final`` (the same step saved again; a file or a symlink someone put there) is
    replaced only after the new one is in place under its temporary name, and removed afterwards.
    """
    _write_durably(tmp / MARKER, marker if marker is not None else final.name + "\n")
    _fsync_dir(tmp)
    old = None
    if os.path.lexists(final):
        old = final.with_name(_OLD_PREFIX + final.name)
        remove(old)
        os.replace(final, old)
    os.replace(tmp, final)
    _fsync_dir(final.parent)
    write_pointer(final.parent, final.name)
    if old is not None:
        remove(old)


def remove(path: Path) -> None:
    """Delete ``path`` whatever it is (a directory tree, a file, a symlink: the link, never its target);
    nothing when it does not exist; errors are ignored (best effort, like ``rmtree(ignore_errors=True)``)."""
    try:
        if path.is_symlink() or not path.is_dir():
            path.unlink(missing_ok=True)
        else:
            shutil.rmtree(path, ignore_errors=True)
    except OSError:
        pass


def write_pointer(root: Path, name: str) -> bool:
    """Atomically replace ``root/latest`` with ``name``; returns False (and logs a warning) when that fails:
    the pointer is informational (resume never reads it), so a checkpoint is never failed for it."""
    tmp = root / f".{POINTER}.tmp-{os.getpid()}"
    try:
        _write_durably(tmp, name + "\n")
        os.replace(tmp, root / POINTER)
    except OSError as exc:
        remove(tmp)
        log.warning("could not update %s to %s (%s); it is informational only, the checkpoint is saved",
                    root / POINTER, name, exc.strerror or exc)
        return False
    _fsync_dir(root)
    return True


def read_pointer(run_dir: PathLike) -> Optional[str]:
    try:
        return (checkpoints_dir(run_dir) / POINTER).read_text().strip() or None
    except (OSError, UnicodeDecodeError):  # the pointer is only a hint: resume scans the directories
        return None


def prune(run_dir: PathLike, keep_last: Optional[int], keep: Optional[Path] = None,
          good: Optional[Callable[[Path], bool]] = None) -> list[Path]:
    """Delete checkpoints beyond the ``keep_last`` newest good ones, every interrupted save (a temporary
    directory without its marker) except ``keep``, and every earlier copy of a re-saved step a crash left
    (``.tmp-old-step-N``, once the new save of step N is in place); returns what was removed.

    The checkpoints are the complete ones and the sealed temporaries (a resume loads those too); ``good(path)``
    (default: all are) tells which count towards ``keep_last``. With ``keep`` (the checkpoint just saved),
    checkpoints of a later step are left alone: a resume skipped them as not good (inspect shows why) and
    they are not counted. A checkpoint that is not good is removed only when it is older than every one
    kept. ``keep_last`` None or < 1 keeps every checkpoint. Published directories without a marker are left
    for a human to look at (``hybrid checkpoint inspect``).
    """
    entries = scan(run_dir)
    doomed = [e.path for e in entries if e.interrupted and e.path != keep] + _replaced(run_dir, entries)
    if keep_last is not None and keep_last >= 1:
        doomed += _beyond(entries, keep_last, keep, good or (lambda path: True))
    for path in doomed:
        remove(path)
    return doomed


def _replaced(run_dir: PathLike, entries: list[Entry]) -> list[Path]:
    """``publish``'s ``.tmp-old-step-N`` copies a crash left behind: the earlier save of a step whose new
    save is in place (published, or sealed under its temporary name), so nothing loads them."""
    root, there = checkpoints_dir(run_dir), {e.step for e in entries if e.complete or e.sealed}
    if not root.is_dir():
        return []
    old = [(child, _STEP_RE.fullmatch(child.name.removeprefix(_OLD_PREFIX))) for child in root.iterdir()
           if child.name.startswith(_OLD_PREFIX)]
    return [child for child, match in old if match and not match.group(1) and int(match.group(2)) in there]


def _beyond(entries: list[Entry], keep_last: int, keep: Optional[Path], good: Callable[[Path], bool]) -> list:
    """The checkpoints ``prune`` removes for ``keep_last`` (see there), oldest first."""
    limit = step_of(keep) if keep is not None and _STEP_RE.match(keep.name) else None
    ours = [e for e in entries if (e.complete or e.sealed) and (limit is None or e.step <= limit)]
    verdict = {e.path: e.path == keep or good(e.path) for e in ours}
    kept = [e for e in reversed(ours) if verdict[e.path]][:keep_last]
    oldest_kept = min((e.step for e in kept), default=-1)
    return [e.path for e in ours if e not in kept and (verdict[e.path] or e.step < oldest_kept)]


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
