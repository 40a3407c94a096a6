"""Is every file of a checkpoint what was written? Per-file crc32s, the marker's seal, and their checks.

No torch process group here: these are the pieces that ``inspect``, ``consolidate`` (one process) and the
ranks' collective choice of a checkpoint (``hybrid.checkpoint.agreement``) share.

What a checkpoint of format 3 records:

* ``hybrid.json`` lists, under ``files``, the size and crc32 of every file DCP wrote (its data files and
  ``.metadata``);
* the ``COMPLETE`` marker *seals* the manifest: it holds ``hybrid.json``'s size and crc32, and a crc32 of
  its own content, so a changed byte in the marker is told apart from one in the manifest; and it names
  the checkpoint, so a step directory copied or renamed under another step's name is ``misplaced``
  (resuming it would restart the step count and data position from the wrong step).

So a byte changed anywhere in the directory is reported against the file that holds it: ``corrupt: F``
(checksum or size differs, or the file cannot be decoded), ``truncated: F`` (shorter than recorded),
``missing: F``; a file this process may not read (permissions) is ``unreadable: F``, which is no verdict
on the checkpoint: a resume stops there (exit 2) rather than skip a checkpoint that may be good. Checksums are computed streaming, ``CHUNK`` bytes at a time, never a whole-file read.

Format 2 (written by an older hybrid) has no checksums. Its checkpoints are *unverified*: what can be
checked is (every data file that DCP's ``.metadata`` names exists and is long enough for the items it
holds), the rest is said plainly (``complete (unverified: ...)``) and such checkpoints are still loaded.
"""

from __future__ import annotations

import json
import os
import re
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Mapping, Optional

from hybrid.checkpoint import manifest as manifest_doc
from hybrid.checkpoint.layout import DCP_METADATA, MANIFEST, MARKER, step_name, step_of
from hybrid.errors import CheckpointError

CHUNK = 4 << 20
UNVERIFIED = "unverified: saved by an older hybrid without checksums, only the file sizes were checked"
MISSING, TRUNCATED, CORRUPT, MISPLACED = "missing", "truncated", "corrupt", "misplaced"
UNREADABLE = "unreadable"  # not damage: this process may not read the file (permissions)
KINDS = (MISSING, TRUNCATED, CORRUPT, MISPLACED, UNREADABLE)  # code in a collective verdict: index + 1
_LEGACY_MARKER = re.compile(r"^step-\d+\s*$")
# the fix in every CheckpointDamaged sentence
FIX = "resume or consolidate an older checkpoint (hybrid checkpoint inspect lists them), or delete this one."
# the fix in every CheckpointUnreadable sentence
UNREADABLE_FIX = "make its files readable by the user that runs hybrid (permissions, ownership), then run again."


@dataclass(frozen=True)
class Expected:
    """What a file must be: ``size`` bytes exactly with this ``crc32``; or, without a checksum (format 2),
    at least ``size`` bytes."""

    size: int
    crc32: Optional[int]


@dataclass(frozen=True)
class Problem:
    kind: str  # missing | truncated | corrupt | misplaced | unreadable
    file: str

    def __str__(self) -> str:
        if self.kind == MISPLACED:  # intact, but written as another step's checkpoint
            return f"{self.kind}: {self.file} names another step (a checkpoint copied or renamed here)"
        return f"{self.kind}: {self.file}"


class CheckpointDamaged(CheckpointError):
    """A published checkpoint whose files are not what was written; ``problem`` says which and how."""

    def __init__(self, directory: Path, problem: Problem, fix: str):
        self.directory, self.problem = Path(directory), problem
        super().__init__(f"{directory} is damaged ({problem}); {fix}")


class CheckpointUnreadable(CheckpointDamaged):
    """A checkpoint with a file this process may not read: no verdict on its content, so never skipped."""

    def __init__(self, directory: Path, problem: Problem, fix: str = UNREADABLE_FIX):
        self.directory, self.problem = Path(directory), problem
        CheckpointError.__init__(self, f"cannot read {Path(directory) / problem.file} (permission denied), "
                                       f"so checkpoint {directory} cannot be verified; {fix}")


def refusal(directory: Path, problem: Problem) -> CheckpointDamaged:
    """The one-sentence error for ``problem`` in the checkpoint ``directory``."""
    if problem.kind == UNREADABLE:
        return CheckpointUnreadable(directory, problem)
    return CheckpointDamaged(directory, problem, FIX)


@dataclass(frozen=True)
class Inventory:
    """A checkpoint's manifest, every file it must hold, and whether those carry checksums."""

    manifest: dict
    files: dict  # name -> Expected, in name order
    checksummed: bool


def digest(path: Path) -> tuple[int, int]:
    """``(size, crc32)`` of a file, read ``CHUNK`` bytes at a time."""
    crc, size = 0, 0
    with open(path, "rb") as f:
        while block := f.read(CHUNK):
            crc = zlib.crc32(block, crc)
            size += len(block)
    return size, crc


def files_section(sums: Mapping[str, tuple[int, int]]) -> dict:
    """The manifest's ``files``: ``{name: {"bytes": size, "crc32": crc}}`` in name order."""
    return {name: {"bytes": int(size), "crc32": int(crc)} for name, (size, crc) in sorted(sums.items())}


# -- the marker's seal ------------------------------------------------------------------------------------
def _seal_crc(body: Mapping) -> int:
    return zlib.crc32(json.dumps(body, sort_keys=True).encode())


def seal_text(directory: Path, name: str) -> str:
    """The marker content for a checkpoint whose manifest is already written in ``directory``."""
    size, crc = digest(Path(directory) / MANIFEST)
    body = {"checkpoint": name, "manifest_bytes": size, "manifest_crc32": crc}
    return json.dumps({**body, "crc32": _seal_crc(body)}, sort_keys=True) + "\n"


def _read_seal(directory: Path) -> tuple[Optional[dict], str]:
    """``(the marker's seal, the checkpoint name it states)``; the seal is None for an old-style marker
    (format 2: the checkpoint's name alone)."""
    try:
        text = (directory / MARKER).read_bytes().decode()
    except FileNotFoundError:
        raise CheckpointDamaged(directory, Problem(MISSING, MARKER), FIX) from None
    except PermissionError:
        raise CheckpointUnreadable(directory, Problem(UNREADABLE, MARKER)) from None
    except (OSError, UnicodeDecodeError):
        raise CheckpointDamaged(directory, Problem(CORRUPT, MARKER), FIX) from None
    if _LEGACY_MARKER.match(text):
        return None, text.strip()
    try:
        seal = json.loads(text)
        body = {k: seal[k] for k in ("checkpoint", "manifest_bytes", "manifest_crc32")}
        good = set(seal) == set(body) | {"crc32"} and seal["crc32"] == _seal_crc(body)
    except (ValueError, TypeError, KeyError):
        good = False
    if not good:
        raise CheckpointDamaged(directory, Problem(CORRUPT, MARKER), FIX)
    return seal, seal["checkpoint"]


# -- what a checkpoint must hold ----------------------------------------------------------------------------
def inventory(directory) -> Inventory:
    """Read the marker and the manifest (small files) and list what the checkpoint must hold.

    Raises ``CheckpointDamaged`` when the marker, the manifest or (format 2) DCP's metadata is missing or
    does not match its seal; ``CheckpointError`` when the directory is not a hybrid checkpoint at all.
    """
    directory = Path(directory)
    seal, sealed_name = _read_seal(directory)
    named = _named_step(directory)
    if named is not None and sealed_name != step_name(named):
        raise CheckpointDamaged(directory, Problem(MISPLACED, MARKER), FIX)
    path = directory / MANIFEST
    if seal is not None:
        try:
            size, crc = digest(path)
        except FileNotFoundError:
            raise CheckpointDamaged(directory, Problem(MISSING, MANIFEST), FIX) from None
        except PermissionError:
            raise CheckpointUnreadable(directory, Problem(UNREADABLE, MANIFEST)) from None
        except OSError:
            raise CheckpointDamaged(directory, Problem(CORRUPT, MANIFEST), FIX) from None
        if size < seal["manifest_bytes"]:
            raise CheckpointDamaged(directory, Problem(TRUNCATED, MANIFEST), FIX)
        if (size, crc) != (seal["manifest_bytes"], seal["manifest_crc32"]):
            raise CheckpointDamaged(directory, Problem(CORRUPT, MANIFEST), FIX)
    elif not path.is_file():
        raise CheckpointDamaged(directory, Problem(MISSING, MANIFEST), FIX)
    elif not os.access(path, os.R_OK):
        raise CheckpointUnreadable(directory, Problem(UNREADABLE, MANIFEST))
    try:
        doc = manifest_doc.read(directory)
    except CheckpointError:
        if seal is None:  # format 2 sealed nothing: a manifest that does not parse is damaged
            raise CheckpointDamaged(directory, Problem(CORRUPT, MANIFEST), FIX) from None
        raise  # sealed and intact, so it really is another format
    # Format 2 sealed nothing: a hand-edited manifest is damaged, like a flipped byte (checked before the step
    # is read as a number below).
    if seal is None and "files" not in doc and _malformed(doc):
        raise CheckpointDamaged(directory, Problem(CORRUPT, MANIFEST), FIX)
    if named is not None and doc.get("step") is not None and int(doc["step"]) != named:
        raise CheckpointDamaged(directory, Problem(MISPLACED, MANIFEST), FIX)
    if "files" in doc:
        if seal is None:  # a format-3 manifest is always sealed: the marker was rewritten
            raise CheckpointDamaged(directory, Problem(CORRUPT, MARKER), FIX)
        files = {name: Expected(int(f["bytes"]), int(f["crc32"])) for name, f in sorted(doc["files"].items())}
        return Inventory(doc, files, True)
    return Inventory(doc, _legacy_files(directory), False)


def _malformed(doc: dict) -> bool:
    """Whether the values the loader reads from a manifest have the wrong type (``"world": null``,
    ``"step": "two"``): the loader would fail with a raw TypeError or ValueError."""
    try:
        for key in ("step", "optimizer_step_count", "global_step"):
            int(doc[key])
        world = doc["world"]
        for key in ("world_size", "dp", "tp"):
            int(world[key])
        return not all(isinstance(doc.get(key, {}), dict)
                       for key in ("params", "frozen", "buffers", "aliases", "optimizer", "extra"))
    except (KeyError, TypeError, ValueError):
        return True


def _named_step(directory: Path) -> Optional[int]:
    """The step a checkpoint directory's name says (``step-N`` or ``.tmp-step-N``), None if not so named."""
    try:
        return step_of(directory)
    except ValueError:
        return None


def _legacy_files(directory: Path) -> dict:
    """Format 2: every file DCP's metadata names, with the least size its items need; ``.metadata`` must
    unpickle."""
    from torch.distributed.checkpoint import FileSystemReader

    if not (directory / DCP_METADATA).is_file():
        raise CheckpointDamaged(directory, Problem(MISSING, DCP_METADATA), FIX)
    if not os.access(directory / DCP_METADATA, os.R_OK):
        raise CheckpointUnreadable(directory, Problem(UNREADABLE, DCP_METADATA))
    try:
        storage = FileSystemReader(directory).read_metadata().storage_data
        need: dict = {}
        for info in storage.values():
            need[info.relative_path] = max(need.get(info.relative_path, 0), int(info.offset) + int(info.length))
    except Exception:  # any unpickling failure of a damaged file
        raise CheckpointDamaged(directory, Problem(CORRUPT, DCP_METADATA), FIX) from None
    return {name: Expected(size, None) for name, size in sorted(need.items())}


def check_file(directory: Path, name: str, expected: Expected, checksums: bool = True) -> Optional[Problem]:
    """The problem with one file, or None when it is as recorded (``checksums=False``: its size only)."""
    path = Path(directory) / name
    try:
        size = os.stat(path).st_size
    except FileNotFoundError:
        return Problem(MISSING, name)
    except PermissionError:  # a directory above it we may not search
        return Problem(UNREADABLE, name)
    except OSError:  # an I/O error: not what was written, for our purpose
        return Problem(CORRUPT, name)
    if size < expected.size:
        return Problem(TRUNCATED, name)
    if expected.crc32 is None:
        return None
    if size != expected.size:
        return Problem(CORRUPT, name)
    if not checksums:
        return None if os.access(path, os.R_OK) else Problem(UNREADABLE, name)
    try:
        _, crc = digest(path)
    except PermissionError:
        return Problem(UNREADABLE, name)
    except OSError:
        return Problem(CORRUPT, name)
    return None if crc == expected.crc32 else Problem(CORRUPT, name)


def check_files(directory: Path, files: Mapping[str, Expected], names: Optional[Iterable[str]] = None,
                checksums: bool = True) -> list:
    """The problems of ``names`` (default: every file), in name order."""
    chosen = sorted(files if names is None else names)
    return [p for p in (check_file(directory, n, files[n], checksums) for n in chosen) if p is not None]


def verify(directory) -> tuple[Inventory, list]:
    """``(inventory, problems)`` of a whole checkpoint, in this process (it reads every byte).

    Raises ``CheckpointDamaged`` when the marker or manifest is damaged (the inventory cannot be read).
    """
    inv = inventory(directory)
    return inv, check_files(Path(directory), inv.files)


def looks_intact(directory: Path) -> bool:
    """A cheap verdict (small files and file sizes; no data read): the marker seals the manifest, the name
    matches, every file is there at its recorded size. What ``prune`` counts as a good checkpoint."""
    try:
        inv = inventory(directory)
    except CheckpointError:
        return False
    return not check_files(Path(directory), inv.files, checksums=False)


def assign(files: Mapping[str, Expected], world_size: int) -> dict:
    """``{name: rank}``: who verifies which file, balancing bytes (largest first, to the least loaded rank,
    ties to the lowest rank); a pure function of the inventory, so every rank computes the same."""
    load = [0] * max(1, world_size)
    out = {}
    for name in sorted(files, key=lambda n: (-files[n].size, n)):
        rank = min(range(len(load)), key=lambda r: (load[r], r))
        out[name] = rank
        load[rank] += files[name].size
    return out
