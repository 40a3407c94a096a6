"""A watchdog that cleans up after an embedded Ray cluster when the launcher dies without doing it.

The launcher stops its embedded cluster itself on every way out it sees (``launch.ray.cluster``), but a
SIGKILL -- the kernel's OOM killer, ``kill -9``, a scheduler's hard stop -- gives it no chance: the GCS and
the raylets die with it (``PR_SET_PDEATHSIG``), while their dashboard and runtime-env agents outlive it,
waiting on the dead GCS, and the temp dir stays behind. ``Reaper.start(base, logs_to)`` starts this module
as a process of its own (its own session, so no signal to the launcher's terminal or process group reaches
it) holding the read end of a pipe whose write end only the launcher holds. ``release()``, the launcher's
last teardown step, says "done" and closes it: the watchdog exits. When the pipe closes without "done",
the launcher is gone, and the watchdog does the teardown's work: stop every process marked by ``base``,
keep the session logs in ``logs_to``, remove ``base`` (``launch.ray.embedded_processes.clean_up``).

Neither the temp dir nor ``RAY_TMPDIR`` appears in the watchdog's command line or environment (they travel
through the pipe), so ``marked_pids`` never counts it among the cluster's processes. It ignores SIGINT,
SIGTERM and SIGHUP: its life is bounded by the launcher's anyway, and a stop of every process of a control
group (systemd, Slurm) must not take it down before the launcher it watches.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Optional

DONE = b"done\n"
RELEASE_WAIT_S = 5.0


class Reaper:
    """The launcher's end of the watchdog: its pipe and its process."""

    def __init__(self, process: subprocess.Popen, pipe: int):
        self._process, self._pipe = process, pipe

    @classmethod
    def start(cls, base: str, logs_to: Optional[Path]) -> Optional["Reaper"]:
        """Start the watchdog for the embedded cluster at ``base``; None where it cannot start (the job runs
        without it, as before it existed)."""
        read, write = os.pipe()
        env = {k: v for k, v in os.environ.items() if k != "RAY_TMPDIR"}
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(__file__).resolve().parents[1]),
                                                          env.get("PYTHONPATH")]))
        try:
            process = subprocess.Popen(
                [sys.executable, "-m", "launch.ray.reaper", str(read)], pass_fds=(read,), cwd="/", env=env,
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, start_new_session=True)
        except OSError:
            os.close(write)
            return None
        finally:
            os.close(read)
        os.write(write, f"{base}\n{logs_to or ''}\n".encode())
        return cls(process, write)

    def release(self) -> None:
        """The launcher cleaned up itself: let the watchdog go, and wait for it to exit."""
        try:
            os.write(self._pipe, DONE)
        except OSError:
            pass
        os.close(self._pipe)
        try:
            self._process.wait(RELEASE_WAIT_S)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()


def watch(pipe: int) -> None:
    """Block until the launcher closes ``pipe``; clean up unless it said it did."""
    chunks = []
    with os.fdopen(pipe, "rb") as reader:
        while chunk := reader.read(4096):
            chunks.append(chunk)
    told = b"".join(chunks)
    if told.endswith(DONE):
        return
    lines = told.decode(errors="surrogateescape").split("\n")
    if len(lines) < 2 or not lines[0]:
        return  # the launcher died before it named its cluster: nothing of it can be known
    from launch.ray.embedded_processes import clean_up

    clean_up(lines[0], Path(lines[1]) if lines[1] else None)


if __name__ == "__main__":
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    watch(int(sys.argv[1]))
