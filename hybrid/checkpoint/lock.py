"""One job at a time per checkpoint directory: an exclusive ``fcntl.flock`` lock on ``checkpoints/.lock``.

The process that writes and publishes checkpoints (rank 0) holds it from before the resume to the end of
training (``hybrid.checkpoint.agreement.exclusive`` makes every rank fail together when it cannot). The file
holds the holder's pid and host, so a second job's one-sentence refusal names them. The operating system
drops the lock when its process exits, however it exits, so a crashed job never leaves a stale lock; a
restarted attempt whose previous rank 0 is still exiting waits up to ``WAIT_S`` for it.

``flock`` rather than POSIX record locks (``lockf``): a record lock is dropped when the process closes
*any* descriptor of the file (reading the lock file to name its holder would unlock it); Linux's NFS client
emulates ``flock`` with record locks, so it holds across nodes there too. A second ``flock`` on another
descriptor conflicts even in the same process, so a process keeps one descriptor per directory and counts
its holders (``acquire`` is re-entrant; the last ``release`` unlocks).
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import socket
import time
from pathlib import Path

from hybrid.checkpoint import layout
from hybrid.errors import CheckpointError

log = logging.getLogger(__name__)

LOCK = ".lock"
WAIT_S = 15.0  # how long a second job waits for the holder to go before it is refused
SAME_JOB_WAIT_S = 180.0  # how long an attempt waits for an earlier attempt of its own job (a dying rank 0)
_POLL_S = 0.2
_held: dict[Path, list] = {}  # lock file -> [descriptor, holders] in this process


class CheckpointLocked(CheckpointError):
    """Another job (another process) holds the checkpoint directory's lock."""


def lock_path(run_dir) -> Path:
    return layout.checkpoints_dir(run_dir) / LOCK


def acquire(run_dir, wait_s: float | None = None) -> Path:
    """Take ``run_dir``'s checkpoint lock for this process (creating ``checkpoints/``), waiting up to
    ``wait_s`` (default ``WAIT_S``) for another holder to go; returns the lock file.

    Raises ``CheckpointLocked`` naming the directory and the holder when it stays held, and
    ``CheckpointError`` when the directory is laid out so that checkpoints cannot be written
    (``layout.layout_problem``) or the lock file cannot be created.
    """
    problem = layout.layout_problem(run_dir)
    if problem is not None:
        raise CheckpointError(f"job.checkpoint.dir {run_dir}: {problem}.")
    path = _key(run_dir)
    if path in _held:
        _held[path][1] += 1
        return path
    fd = _open(path)
    started = time.monotonic()
    while not _try_lock(fd):
        waited = time.monotonic() - started
        limit = SAME_JOB_WAIT_S if _held_by_this_job(run_dir) else (WAIT_S if wait_s is None else wait_s)
        if waited >= limit:
            os.close(fd)
            raise _locked(run_dir, path)
        time.sleep(_POLL_S)
    _held[path] = [fd, 1]
    try:  # who holds it, for a second job's message: best effort (a full disk must not lose the lock)
        os.ftruncate(fd, 0)
        job = job_id()
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}{f', job {job}' if job else ''}\n".encode(), 0)
    except OSError:
        pass
    return path


def job_id():
    """What names this job across its attempts: the launcher's ``HYBRID_JOB_ID``, else torchrun's run id."""
    run = os.environ.get("HYBRID_JOB_ID") or os.environ.get("TORCHELASTIC_RUN_ID")
    return run if run and run != "none" else None


def _held_by_this_job(run_dir) -> bool:
    job = job_id()
    return job is not None and holder(run_dir).endswith(f", job {job}")


def _key(run_dir) -> Path:
    return lock_path(run_dir).resolve()  # one key per directory, however it is spelt


def _close_in_child() -> None:
    """A forked child (a DataLoader worker) drops its copies of the lock's descriptor: the parent keeps the
    lock, and it goes when the parent exits even if a child lives on."""
    for fd, _ in _held.values():
        try:
            os.close(fd)
        except OSError:
            pass
    _held.clear()


os.register_at_fork(after_in_child=_close_in_child)


def release(run_dir) -> None:
    """Drop one hold of ``run_dir``'s lock by this process; the last one unlocks (the file stays)."""
    path = _key(run_dir)
    entry = _held.get(path)
    if entry is None:
        return
    entry[1] -= 1
    if entry[1] <= 0:
        del _held[path]
        try:
            os.ftruncate(entry[0], 0)
        except OSError:
            pass
        os.close(entry[0])  # closing drops the lock


def holder(run_dir) -> str:
    """What the lock file says about its holder ("pid 123 on host, job J"), or "another process"."""
    try:
        text = lock_path(run_dir).read_text().strip()
    except OSError:
        text = ""
    return text or "another process"


def _locked(run_dir, path: Path) -> CheckpointLocked:
    if _held_by_this_job(run_dir):
        return CheckpointLocked(f"checkpoint directory {layout.checkpoints_dir(run_dir)} is still locked by an "
                                f"earlier attempt of this job ({holder(run_dir)}) after {SAME_JOB_WAIT_S:.0f} s; "
                                "stop that process (or the node it runs on) and launch again.")
    return CheckpointLocked(f"checkpoint directory {layout.checkpoints_dir(run_dir)} is in use by another job "
                            f"({holder(run_dir)} holds {path.name}); wait for that job to end or stop it, or "
                            f"give this job another job.checkpoint.dir.")


def _open(path: Path) -> int:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        return os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as exc:
        raise CheckpointError(f"cannot create the checkpoint lock {path} ({exc.strerror or exc}); make "
                              f"job.checkpoint.dir writable.") from None


def _try_lock(fd: int) -> bool:
    """True once this process holds the lock; False while another does. A filesystem without locks
    (ENOLCK, some network mounts) is warned about and treated as locked by us: it cannot be checked."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except OSError as exc:
        if exc.errno in (errno.EACCES, errno.EAGAIN, errno.EWOULDBLOCK):
            return False
        log.warning("cannot lock the checkpoint directory (%s); make sure no other job writes to it",
                    exc.strerror or exc)
        return True
