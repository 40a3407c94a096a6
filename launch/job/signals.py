"""SIGINT and SIGTERM as ``KeyboardInterrupt`` (so ``finally`` teardowns run), or ignored for a while.

``as_interrupt(*signals)`` and ``ignored()`` are context managers that install the handler for the
block and restore the previous ones after it; ``with_hangup()`` adds SIGHUP to a set unless it is
ignored (``nohup``); ``take_back()`` re-installs the interrupt inside a block
after a library replaced it; ``reassert()`` re-installs whatever Python believes is installed, after a
library reset it beneath Python. Off the main thread they change nothing (Python allows
signal handlers only there).

An interrupt raised where Python cannot propagate it is not lost: a signal that lands while an at-fork hook
runs (Ray starts its processes with ``subprocess``; logging's hook then swallowed the interrupt and the
launcher went on starting the cluster and trained), in a ``__del__`` or a weakref callback, reaches
``sys.unraisablehook``; inside an ``as_interrupt`` block that hook has the same signal sent again a moment
later, so it is raised at the next point that can raise it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from typing import Iterator

BOTH = (signal.SIGTERM, signal.SIGINT)
_REDELIVER_AFTER_S = 0.01


def with_hangup(signals=BOTH) -> tuple:
    """``signals`` plus SIGHUP unless SIGHUP is ignored now (``nohup``, which must keep working): for a
    block whose child processes do not get a terminal's hangup themselves (an embedded Ray cluster in
    sessions of its own), so that a hangup stops them through the block's teardown instead of killing
    this process outright and orphaning them. Call it before the block installs anything."""
    hup = getattr(signal, "SIGHUP", None)
    if hup is None or hup in signals or signal.getsignal(hup) == signal.SIG_IGN:
        return tuple(signals)
    return (*signals, hup)


class SignalInterrupt(KeyboardInterrupt):
    """The ``KeyboardInterrupt`` a handled signal raises; ``signum`` says which."""

    def __init__(self, signum: int):
        super().__init__(f"signal {signum}")
        self.signum = signum


def _raise_interrupt(signum, frame):
    raise SignalInterrupt(signum)


def _redeliver_swallowed(unraisable, previous) -> None:
    """``sys.unraisablehook`` inside an ``as_interrupt`` block: an interrupt Python had to swallow is sent
    again; anything else goes to the hook that was there before."""
    if isinstance(unraisable.exc_value, SignalInterrupt):
        # From another thread, a moment later: sent from here, the handler would run (and be swallowed) here.
        again = threading.Timer(_REDELIVER_AFTER_S, os.kill, (os.getpid(), unraisable.exc_value.signum))
        again.daemon = True
        again.start()
    else:
        previous(unraisable)


def as_interrupt(*signals: int):
    """Inside the block the signals (default SIGTERM and SIGINT) raise ``KeyboardInterrupt``.

    SIGINT is set explicitly because a launcher started in the background of a non-interactive shell
    inherits it ignored, and then even ``kill -INT`` would leave a cluster running.
    """
    return _interrupting(signals or BOTH)


@contextlib.contextmanager
def _interrupting(signals) -> Iterator[None]:
    if threading.current_thread() is not threading.main_thread():  # no handler there either (``_handled``)
        yield
        return
    previous_hook = sys.unraisablehook
    sys.unraisablehook = lambda unraisable: _redeliver_swallowed(unraisable, previous_hook)
    try:
        with _handled(signals, _raise_interrupt):
            yield
    finally:
        sys.unraisablehook = previous_hook


def ignored(*signals: int):
    """Inside the block the signals (default SIGTERM and SIGINT) are ignored: for a bounded teardown
    that a second Ctrl-C must not cut short."""
    return _handled(signals or BOTH, signal.SIG_IGN)


def take_back(*signals: int) -> None:
    """Inside an ``as_interrupt`` block, after a library installed handlers of its own (Ray does, on every
    node start): the signals raise ``KeyboardInterrupt`` again. The block still restores the originals."""
    try:
        for sig in signals or BOTH:
            signal.signal(sig, _raise_interrupt)
    except ValueError:  # not the main thread
        pass


def reassert(*signals: int) -> None:
    """Install again, at the C level, the handlers Python believes are installed: ``ray.shutdown()`` resets
    SIGTERM to the default action beneath Python (Ray's logging uninstalls its failure handlers), so a
    SIGTERM during the rest of a teardown would kill the launcher before it stops the nodes."""
    try:
        for sig in signals or BOTH:
            handler = signal.getsignal(sig)
            if handler is not None:
                signal.signal(sig, handler)
    except ValueError:  # not the main thread
        pass


@contextlib.contextmanager
def _handled(signals, handler) -> Iterator[None]:
    try:
        previous = {sig: signal.signal(sig, handler) for sig in signals}
    except ValueError:  # not the main thread: leave signals alone
        yield
        return
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)
