"""The ranks' output on the driver's terminal: every line as printed, all of it before the driver moves on.

Ray forwards what the ranks print to the driver (its log monitor tails their files and publishes batches),
but by default it merges lines that differ only in numbers across workers (``[repeated 3x across
cluster]``): ``no_dedup()``, called before Ray is imported, turns that off unless the user set
``RAY_DEDUP_LOGS`` themselves. ``LogActivity`` watches the batches the driver receives (a handler on Ray's
stdstream dispatcher); ``settle()`` waits until none has arrived for ``QUIET_S`` (at most ``MAX_WAIT_S``), so
a rank's last lines are on the terminal before the summary and the teardown, instead of lost with it. Where
Ray's private dispatcher is missing (another Ray version) nothing is watched and ``settle()`` returns at once:
the full output is in the Ray session's logs either way.
"""

from __future__ import annotations

import os
import threading
import time

QUIET_S = 0.5
MAX_WAIT_S = 10.0
_HANDLER = "hybrid_log_activity"


def no_dedup() -> None:
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")


class LogActivity:
    def __init__(self):
        self._last = time.monotonic()
        self._lock = threading.Lock()
        try:
            from ray._private.ray_logging import global_worker_stdstream_dispatcher as dispatcher
        except ImportError:
            dispatcher = None
        self._dispatcher = dispatcher if hasattr(dispatcher, "add_handler") else None
        if self._dispatcher is not None:
            self._dispatcher.remove_handler(_HANDLER)
            self._dispatcher.add_handler(_HANDLER, self._seen)

    def _seen(self, _data) -> None:
        with self._lock:
            self._last = time.monotonic()

    def settle(self, quiet_s: float = QUIET_S, max_s: float = MAX_WAIT_S) -> None:
        if self._dispatcher is None:
            return
        deadline = time.monotonic() + max_s
        with self._lock:
            self._last = max(self._last, time.monotonic())  # the log monitor's next batch may still be coming
        while time.monotonic() < deadline:
            with self._lock:
                quiet = time.monotonic() - self._last
            if quiet >= quiet_s:
                return
            time.sleep(min(quiet_s - quiet, 0.1) + 0.01)

    def close(self) -> None:
        if self._dispatcher is not None:
            self._dispatcher.remove_handler(_HANDLER)
