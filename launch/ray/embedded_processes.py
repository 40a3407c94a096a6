"""Find, stop and clean up after the processes of one embedded Ray cluster, by its temp dir alone.

Every process an embedded cluster starts is marked by the cluster's ``hybrid-ray-*`` temp dir (its command
line names it, or its environment has it as ``RAY_TMPDIR``, or, retitled ``ray::...``, it holds a file open
under it). ``marked_pids(base)`` lists them, ``kill_marked(base)`` stops them (SIGTERM, then SIGKILL),
``keep_logs(base, target)`` moves the cluster's session logs out before ``base`` is removed. Standard
library only: ``launch.ray.reaper`` runs these in a process of its own that must start in milliseconds.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import time
from pathlib import Path
from typing import Iterator

log = logging.getLogger(__name__)


def processes(proc: Path = Path("/proc")) -> Iterator[tuple[int, str]]:
    """(pid, command line) of every process we can see, this one excepted."""
    for entry in proc.iterdir() if proc.is_dir() else ():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                yield int(entry.name), (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue


def marked_pids(base: str, proc: Path = Path("/proc")) -> list[int]:
    """Pids of live processes whose command line names the embedded cluster's temp dir ``base``, or whose
    environment has it as ``RAY_TMPDIR`` (Ray's dashboard and runtime-env agents retitle themselves
    ``ray::...``, so only their inherited environment still says whose they are), or, titled ``ray::...``,
    that hold a file open under it."""
    mark = f"\0RAY_TMPDIR={base}\0".encode()
    return [pid for pid, cmdline in processes(proc)
            if base in cmdline or mark in _environ(proc, pid)
            or (cmdline.startswith("ray::") and _holds_open(proc, pid, base))]


def _holds_open(proc: Path, pid: int, base: str) -> bool:
    """Whether the process's working directory or an open file lies under ``base``: how a Ray agent that
    retitled itself (``ray::...``) without inheriting ``RAY_TMPDIR`` is still known (its log files are there).
    Only asked of such processes, never of a user's shell or pager reading the logs."""
    root = base.rstrip("/")
    try:
        links = [proc / str(pid) / "cwd", *(proc / str(pid) / "fd").iterdir()]
    except OSError:
        return False
    for link in links:
        try:
            target = os.readlink(link)
        except OSError:
            continue
        if target == root or target.startswith(root + "/"):
            return True
    return False


def _environ(proc: Path, pid: int) -> bytes:
    """``/proc/PID/environ`` as NUL-terminated entries (empty when it cannot be read: another user's)."""
    try:
        return b"\0" + (proc / str(pid) / "environ").read_bytes() + b"\0"
    except OSError:
        return b""


def kill_marked(base: str, grace_s: float = 3.0) -> None:
    """Stop every process of the cluster at ``base``: SIGTERM, and SIGKILL for those alive ``grace_s`` later."""
    pids = marked_pids(base)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            with contextlib.suppress(OSError):
                os.kill(pid, sig)
        deadline = time.monotonic() + grace_s
        while pids and time.monotonic() < deadline:
            pids = [p for p in pids if alive(p)]
            time.sleep(0.1)
        if not pids:
            return


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[-1].split()[0] != "Z"
    except OSError:
        return False


KEPT_LOGS = "ray-logs"  # the run directory's copy of an embedded cluster's session logs
PREVIOUS_SUFFIX = ".previous"  # the launch before's, beside it


def keep_logs(base: str, target: Path) -> None:
    """Move the session logs out of the embedded cluster's temp dir ``base`` to ``target`` before it is removed
    (best effort: a failure to keep logs must not fail the job). The logs already there, the previous
    launch's (a failed run's, say, rerun to resume), become ``<target>.previous``."""
    sessions = sorted(Path(base).glob("ray/session_2*/logs"))
    if not sessions:
        return
    try:
        target = Path(target)
        if target.exists():
            previous = target.with_name(target.name + PREVIOUS_SUFFIX)
            shutil.rmtree(previous, ignore_errors=True)
            target.rename(previous)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(str(sessions[-1]), str(target))
    except OSError as err:
        log.warning("could not keep the embedded cluster's logs in %s: %s", target, err)


def clean_up(base: str, logs_to: "Path | None") -> None:
    """Everything the embedded cluster at ``base`` leaves once its nodes were asked to stop: stop what still
    runs, keep the logs when asked, remove the temp dir."""
    kill_marked(base)
    if logs_to is not None:
        keep_logs(base, logs_to)
    shutil.rmtree(base, ignore_errors=True)
