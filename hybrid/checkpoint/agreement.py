"""What the ranks decide together about checkpoints: the checksums of a save, and which checkpoint to load.

Both are collectives over the world (``hybrid.comm.Comm`` on the default group); call them on every rank.

``record_checksums(directory, metadata, written, comm, device)`` (after ``dcp.save``, which hands every rank
DCP's global metadata): each rank digests the data files it wrote itself (the files of its own final save
plan, still in its page cache), rank 0 also ``.metadata`` and any file no rank claimed; one all-reduce of
``[claimed, size, crc32]`` per file gives every rank the manifest's ``files`` section.

``choose(path, comm, device, fallback)``: rank 0 alone lists the candidates (the newest first) and
broadcasts each in turn, so a shared filesystem whose attribute cache shows the ranks different directory
listings cannot make them load different checkpoints. Each rank reads the candidate's marker and manifest
(small files) and verifies its share of the files (``integrity.assign``: balanced by bytes, so the
checkpoint is read once, spread over the ranks -- cheaper than each rank verifying what it will load, which
at ZeRO stage 0 is everything); one all-reduce (max) of a per-file verdict tells every rank which file, if
any, is missing, truncated or corrupt. With ``fallback`` a bad candidate is skipped for the next older one
(``Choice.skipped``, the same on every rank); no candidate but interrupted saves means a fresh start, but
checkpoints that are all damaged make every rank raise the same ``CheckpointError`` (a fresh start would
overwrite and prune them). Without ``fallback`` the one candidate must be good, or every rank raises the
same ``CheckpointDamaged``. A file a rank may not read (``unreadable``) is no verdict on the checkpoint:
every rank raises the same ``CheckpointUnreadable``, with or without ``fallback``.

``exclusive(run_dir, comm, device)``: rank 0 holds the checkpoint directory's lock (``hybrid.checkpoint.lock``)
for the block; when another job holds it, every rank raises the same ``CheckpointLocked``.
"""

from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

from hybrid.checkpoint import integrity, layout, lock
from hybrid.checkpoint.integrity import CheckpointDamaged, Inventory, Problem
from hybrid.comm.collectives import Comm
from hybrid.errors import CheckpointError

log = logging.getLogger(__name__)

# what rank 0 broadcasts in each round: [what, step, where, n_files, problem kind, problem file]
_NONE, _ERROR, _DAMAGED, _CANDIDATE = range(4)
_FINAL, _TEMPORARY, _GIVEN = range(3)  # where the candidate lives
_SMALL = (layout.MARKER, layout.MANIFEST, layout.DCP_METADATA)  # files rank 0 checks before broadcasting


@dataclass(frozen=True)
class Choice:
    """The verified checkpoint to load (None: start fresh), and what was skipped on the way, newest first."""

    path: Optional[Path]
    inventory: Optional[Inventory] = None
    skipped: list = field(default_factory=list)  # (checkpoint directory, Problem)


def record_checksums(directory: Path, metadata, written, comm: Comm, device) -> dict:
    """The manifest's ``files`` section (complete on rank 0) for a save whose DCP files are all written
    (collective). ``metadata`` is what ``dcp.save`` returned; ``written`` the write items of this rank's final
    plan."""
    storage = metadata.storage_data
    names = sorted({info.relative_path for info in storage.values()} | {layout.DCP_METADATA})
    mine = {storage[item.index].relative_path for item in written if item.index in storage}
    if comm.rank == 0:
        mine.add(layout.DCP_METADATA)
    table = torch.zeros(len(names), 3, dtype=torch.int64)
    for i, name in enumerate(names):
        if name in mine:
            table[i] = torch.tensor([1, *integrity.digest(directory / name)])
    table = table.to(device)
    comm.all_reduce(table)
    table = table.cpu()
    sums = {}
    for i, name in enumerate(names):
        claimed, size, crc = (int(v) for v in table[i])
        if claimed:
            sums[name] = (size, crc)
        elif comm.rank == 0:  # no rank's plan named it (not expected of DCP): rank 0, which writes the manifest
            sums[name] = integrity.digest(directory / name)
    return integrity.files_section(sums)


def _candidates(path: Path, fallback: bool) -> list:
    """Rank 0: ``(directory, where, step)`` to try, newest first; CheckpointError for a path that is none."""
    if not fallback:
        ckpt = layout.resolve(path)
        if layout.is_checkpoint_dir(path):
            return [(ckpt, _GIVEN, 0)]
        return [(ckpt, _FINAL, layout.step_of(ckpt))]
    problem = _not_a_run_dir(path)
    if problem is not None:
        raise problem
    entries = layout.candidates(layout.run_dir_of(path))
    return [(e.path, _TEMPORARY if e.temporary else _FINAL, e.step) for e in entries]


def _not_a_run_dir(path: Path) -> Optional[CheckpointError]:
    """Why a resume cannot look for checkpoints under ``path`` (it would silently start fresh, and save
    where no resume looks), or None."""
    if layout.is_checkpoint_dir(path):
        return CheckpointError(f"{path} is one checkpoint, not a run directory; resume with the run directory "
                               f"that holds it to load the newest good checkpoint, or load this one with "
                               f"hybrid.checkpoint.load.")
    if os.path.lexists(path) and not path.is_dir():
        return CheckpointError(f"{path} is a file, not a run directory; pass the directory the job writes its "
                               f"checkpoints under.")
    problem = layout.layout_problem(layout.run_dir_of(path))
    return CheckpointError(f"cannot resume from {path}: {problem}.") if problem else None


def _where(path: Path, where: int, name: str) -> Path:
    """The candidate on this rank: ``path`` itself, or rank 0's directory ``name`` in the run's checkpoints
    (by name, not rebuilt from its step: a directory renamed ``step-3`` is still a checkpoint)."""
    return path if where == _GIVEN else layout.checkpoints_dir(layout.run_dir_of(path)) / name


def _encode(problem: Problem, names) -> tuple[int, int]:
    return integrity.KINDS.index(problem.kind) + 1, list(names).index(problem.file)


def _decode(kind: int, index: int, names) -> Problem:
    return Problem(integrity.KINDS[kind - 1], list(names)[index])


def choose(path, comm: Comm, device, *, fallback: bool) -> Choice:
    """The checkpoint every rank loads (collective); see the module docstring."""
    path = Path(path)
    pending, error = [], None
    if comm.rank == 0:
        try:
            pending = _candidates(path, fallback)
        except CheckpointError as exc:
            error = exc
    skipped, interrupted = [], 0  # interrupted: how many of the skipped are saves that never finished
    while True:
        # [what, step, where, n_files or "the error is the candidate's", problem kind, problem file]
        head = torch.zeros(6, dtype=torch.int64)
        inv = None
        if comm.rank == 0:
            if error is not None:
                head[0] = _ERROR
            elif pending:
                ckpt, where, step = pending.pop(0)
                head[1:3] = torch.tensor([step, where])
                try:
                    inv = integrity.inventory(ckpt)
                    head[0], head[3] = _CANDIDATE, len(inv.files)
                except CheckpointDamaged as exc:
                    head[0] = _DAMAGED
                    head[4:6] = torch.tensor(_encode(exc.problem, _SMALL))
                except CheckpointError as exc:  # intact but unreadable here (another format): never skipped
                    head[0], head[3], error = _ERROR, 1, exc
        head = _broadcast(head, comm, device)
        what, _, where, n_files, kind, index = (int(v) for v in head)
        if what != _NONE and (what != _ERROR or n_files):
            name = broadcast_text(ckpt.name if comm.rank == 0 else "", comm, device)
        if what == _NONE:
            if len(skipped) > interrupted:
                raise _none_good(layout.run_dir_of(path), skipped)
            return Choice(None, None, skipped)
        if what == _ERROR:
            if error is None:
                error = _error_elsewhere(path, _where(path, where, name) if n_files else None, fallback)
            raise error
        ckpt = _where(path, where, name)
        if what == _DAMAGED:
            problem = _decode(kind, index, _SMALL)
        else:
            inv, problem = _verify_together(ckpt, inv, n_files, comm, device)
            if problem is None:
                return Choice(ckpt, inv, skipped)
        if not fallback or problem.kind == integrity.UNREADABLE:
            raise integrity.refusal(ckpt, problem)
        if comm.rank == 0:
            log.warning("skipping checkpoint %s: %s", ckpt, problem)
        skipped.append((ckpt, problem))
        interrupted += where == _TEMPORARY and problem == Problem(integrity.MISSING, layout.MARKER)


def _none_good(run_dir: Path, skipped: list) -> CheckpointError:
    """Checkpoints exist but none is good: starting fresh would overwrite and prune them."""
    shown = ", ".join(f"{p.name} ({problem})" for p, problem in skipped[:4])
    more = f" and {len(skipped) - 4} more" if len(skipped) > 4 else ""
    root = layout.checkpoints_dir(run_dir)
    return CheckpointError(f"no good checkpoint in {root} ({shown}{more}), and starting fresh would overwrite "
                           f"them; move {root} aside (or delete it) to start from step 0, or restore a good "
                           f"checkpoint there.")


def _verify_together(ckpt: Path, inv: Optional[Inventory], n_files: int, comm: Comm,
                     device) -> tuple[Optional[Inventory], Optional[Problem]]:
    """Every rank checks its share of ``ckpt``'s files; ``(inventory, the first problem or None)``."""
    verdict = torch.zeros(1 + n_files, dtype=torch.int64)  # [a rank disagrees, each file's problem kind]
    names = []
    try:
        inv = inv or integrity.inventory(ckpt)
        names = list(inv.files)
        if len(names) != n_files:
            raise CheckpointDamaged(ckpt, Problem(integrity.CORRUPT, layout.MANIFEST), integrity.FIX)
    except CheckpointError as exc:  # this rank reads the small files differently from rank 0
        log.warning("rank %d cannot read %s as rank 0 does: %s", comm.rank, ckpt, exc)
        verdict[0] = 1
    else:
        owners = integrity.assign(inv.files, comm.size)
        mine = [n for n in names if owners[n] == comm.rank]
        for problem in integrity.check_files(ckpt, inv.files, mine):
            verdict[1 + names.index(problem.file)] = integrity.KINDS.index(problem.kind) + 1
    verdict = _all_reduce_max(verdict, comm, device)
    if verdict[0]:
        return None, Problem(integrity.CORRUPT, f"{layout.MANIFEST} (another rank read it differently)")
    for i, kind in enumerate(verdict[1:].tolist()):
        if kind:
            return None, _decode(kind, i, names)
    return inv, None


@contextlib.contextmanager
def exclusive(run_dir, comm: Comm, device):
    """Rank 0 holds ``run_dir``'s checkpoint lock for the block (collective on entry): every rank raises
    the same ``lock.CheckpointLocked`` (or ``CheckpointError``, for a directory laid out wrong) when rank 0
    cannot take it. Re-entrant within a process."""
    error, held = None, False
    if comm.rank == 0:
        try:
            lock.acquire(run_dir)
            held = True
        except Exception as exc:  # noqa: BLE001 -- every rank must hear of it, or they wait in any_rank
            error = exc
    try:
        if any_rank(error is not None, comm, device):
            if comm.rank == 0:
                broadcast_text(f"{int(isinstance(error, lock.CheckpointLocked))}{error}", comm, device)
                raise error
            text = broadcast_text("", comm, device)  # rank 0's own sentence, so every rank says the same
            raise (lock.CheckpointLocked if text[0] == "1" else CheckpointError)(text[1:])
        yield
    finally:
        if held:
            lock.release(run_dir)


def any_rank(flag: bool, comm: Comm, device) -> bool:
    """True on every rank when ``flag`` is true on any (collective): how the ranks fail together."""
    return bool(_all_reduce_max(torch.tensor([int(flag)], dtype=torch.int64), comm, device)[0])


def broadcast_text(text: str, comm: Comm, device) -> str:
    """Rank 0's ``text`` on every rank (collective; the others pass anything)."""
    data = torch.tensor(list(text.encode()), dtype=torch.uint8)
    size = int(_broadcast(torch.tensor([data.numel()], dtype=torch.int64), comm, device)[0])
    if comm.rank != 0:
        data = torch.zeros(size, dtype=torch.uint8)
    return bytes(_broadcast(data, comm, device).tolist()).decode() if size else ""


def _broadcast(t: torch.Tensor, comm: Comm, device) -> torch.Tensor:
    t = t.to(device)
    comm.broadcast(t, 0)
    return t.cpu()


def _all_reduce_max(t: torch.Tensor, comm: Comm, device) -> torch.Tensor:
    t = t.to(device)
    comm.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.cpu()


def _error_elsewhere(path: Path, ckpt: Optional[Path], fallback: bool) -> CheckpointError:
    """Rank 0 could not use ``path`` (or its checkpoint ``ckpt``); this rank gives the same sentence where
    it sees the same."""
    if ckpt is None and fallback and (problem := _not_a_run_dir(path)) is not None:
        return problem
    try:
        integrity.inventory(ckpt) if ckpt is not None else layout.resolve(path)
    except CheckpointError as exc:
        return exc
    return CheckpointError(f"rank 0 cannot use {path} as a checkpoint although this rank can; make the "
                           f"checkpoint directory one shared filesystem that every rank sees alike.")

