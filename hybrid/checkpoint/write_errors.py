"""Why a checkpoint could not be written, in one sentence: the disk's cause (full, read-only, quota) where
it can be found, the fix it calls for, and the checkpoint a run of the job again resumes from.

A write that fails for want of space does not always say so: torch's zip writer, which DCP's
``FileSystemWriter`` writes each file through, turns a short write into ``RuntimeError: . unexpected pos
704 vs 598``. ``write_cause(error, directory)`` therefore reads the error first (an ``OSError``'s errno, in
the error or the exceptions it was raised from; a known errno's words in its message) and, where that
names nothing, the filesystem the directory is on (``disk_facts``: read-only, or as good as full), so the
sentence names the cause a user can act on. ``classify`` is the pure decision, ``disk_facts`` the one
system call; call ``write_cause`` before the partial directory is removed (that frees the space).
"""

from __future__ import annotations

import errno
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from hybrid.config.units import human_bytes
from hybrid.errors import CheckpointWriteError, first_line

# A filesystem with less than this free (or less than FULL_FRACTION of its size) is as good as full when a
# write into it failed without saying why.
FULL_BYTES = 1 << 20
FULL_FRACTION = 0.001
# errnos a user fixes at the disk, and the words their messages carry when an errno is lost on the way
_WORDS = {errno.ENOSPC: "No space left on device", errno.EDQUOT: "Disk quota exceeded",
          errno.EROFS: "Read-only file system", errno.EACCES: "Permission denied", errno.EPERM: "Operation not permitted",
          errno.EFBIG: "File too large", errno.EIO: "Input/output error"}


@dataclass(frozen=True)
class DiskFacts:
    """What ``os.statvfs`` says of the filesystem a checkpoint directory is on."""

    free_bytes: int
    total_bytes: int
    read_only: bool


def disk_facts(directory) -> Optional[DiskFacts]:
    """The filesystem of ``directory`` (or of its nearest existing parent); None where it cannot be asked."""
    path = Path(directory)
    while not path.exists() and path != path.parent:
        path = path.parent
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    return DiskFacts(st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize, bool(st.f_flag & os.ST_RDONLY))


def error_errno(error: BaseException) -> Optional[int]:
    """The errno of the first ``OSError`` in ``error``'s chain (itself, then what it was raised from), or
    of the first known errno whose words its messages carry; None when none names one."""
    seen, chain = set(), []
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        chain.append(error)
        error = error.__cause__ or error.__context__
    for err in chain:
        if isinstance(err, OSError) and err.errno:
            return err.errno
    for err in chain:
        for number, words in _WORDS.items():
            if words.lower() in str(err).lower():
                return number
    return None


def classify(number: Optional[int], message: str, facts: Optional[DiskFacts]) -> tuple[str, str]:
    """``(cause, fix)`` of a failed write: the errno's words when the error had one, else the filesystem's
    state (read-only; full: less than ``FULL_BYTES`` or ``FULL_FRACTION`` free: the error's own words, a
    library's, are left to the rank's log then), else the error's own ``message``."""
    if number is None and facts is not None:
        if facts.read_only:
            number = errno.EROFS
        elif facts.free_bytes < max(FULL_BYTES, FULL_FRACTION * facts.total_bytes):
            return (f"{os.strerror(errno.ENOSPC)}: {human_bytes(facts.free_bytes)} free of "
                    f"{human_bytes(facts.total_bytes)}"), fix_for(errno.ENOSPC)
    if number is None:
        return message, fix_for(None)
    return os.strerror(number), fix_for(number)


def fix_for(number: Optional[int]) -> str:
    """What a failed write of the checkpoint directory calls for, by its errno."""
    if number in (errno.EACCES, errno.EPERM, errno.EROFS):
        return "make it writable for every rank"
    if number in (errno.ENOTDIR, errno.EEXIST, errno.EISDIR):
        return "move aside the file that stands where a directory of the path goes (or the directory where a file does)"
    if number == errno.EDQUOT:
        return "raise the quota there or free space under it (or lower job.checkpoint.keep_last)"
    return "free space there (or lower job.checkpoint.keep_last)"


def write_cause(error: BaseException, directory) -> tuple[str, str]:
    """``(cause, fix)`` of ``error``, raised writing into ``directory``; see the module docstring."""
    number = error_errno(error)
    message = f"{type(error).__name__}: {first_line(error)}"
    return classify(number, message, disk_facts(directory) if number is None else None)


def write_failed(step: int, tmp: Path, cause: str, fix: str, *, previous: Optional[Path],
                 wrote: bool = True) -> CheckpointWriteError:
    """The one sentence of a failed save of ``step`` into ``tmp``; ``previous`` is the checkpoint a run of
    the job again resumes from."""
    what = f"the partial {tmp.name} was removed" if wrote else "nothing was written"
    return CheckpointWriteError(
        f"saving the step-{step} checkpoint into {tmp.parent} failed ({cause}; {what}); {fix} and run the job "
        f"again to resume from {previous.name if previous else 'step 0'}.")
