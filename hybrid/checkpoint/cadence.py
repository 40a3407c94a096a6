"""When a training loop saves: every ``every`` steps, every ``every_seconds`` of training, and at the last step.

``due(step, last_step, every, every_seconds, seconds_since_save)`` is the pure decision. A clock differs
from rank to rank, so a time-based save must be agreed: ``Cadence.due`` asks the world whether any rank's
clock says so (one 8-byte all-reduce per step, only when ``every_seconds`` is set), and every rank saves
at the same step.
"""

from __future__ import annotations

import time
from typing import Callable, Optional


def due(step: int, last_step: int, every: int, every_seconds: Optional[float],
        seconds_since_save: float, *, forced: bool = False) -> bool:
    """Whether to save after optimizer step ``step`` (1-based) of ``last_step``: ``forced``, the last step,
    a multiple of ``every`` (when >= 1), or ``every_seconds`` (when set) passed since the last save."""
    return (forced or step == last_step or (every is not None and every >= 1 and step % every == 0)
            or (every_seconds is not None and seconds_since_save >= every_seconds))


class Cadence:
    """A run's save schedule; ``agree(flag)`` returns True on every rank when ``flag`` is true on any."""

    def __init__(self, every: int, every_seconds: Optional[float], last_step: int,
                 agree: Callable[[bool], bool], clock: Callable[[], float] = time.monotonic):
        self.every, self.every_seconds, self.last_step = every, every_seconds, last_step
        self._agree, self._clock = agree, clock
        self._since = clock()

    def due(self, step: int) -> bool:
        """Whether every rank saves after ``step`` (collective when ``every_seconds`` is set)."""
        on_steps = due(step, self.last_step, self.every, None, 0.0)
        if self.every_seconds is None or on_steps:
            return on_steps
        return self._agree(self._clock() - self._since >= self.every_seconds)

    def saved(self) -> None:
        """A save started now: the seconds count from here."""
        self._since = self._clock()
