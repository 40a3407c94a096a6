"""This process's collective heartbeat: how many collectives it has entered, and whether it is inside one.

``hybrid.comm.Comm`` wraps every collective it issues in ``collective(label)``; the launcher's rank actor
reads ``snapshot()`` from another thread and ships it to the driver with the rank's reports. When ranks
fail with timeout symptoms, the driver compares the snapshots (``hung_rank``): the rank that stopped
entering collectives long before the others gave up is the one they were waiting for.

A snapshot is plain data: ``entered`` (collectives issued so far), ``inside`` (the label of the one it is
blocked in, or None), ``since`` (wall-clock time it entered that one, or None) and ``last`` (wall-clock
time of its last entry or exit; the start of the process when none). An async collective counts as
entered when it is issued and is not tracked while its handle is waited on: on NCCL the CPU never blocks
inside a collective anyway, so ``entered`` is the signal that holds for both backends.

``lost_peer(err)`` tells a collective that failed because of its peer (a peer that exited, crashed or never
came within the group's timeout) from any other error: the rank reports those as ``FailureKind.PEER``, a
consequence, so the launcher looks for the rank that caused them. It is the one place where an error's text
is read to decide a failure's kind, because gloo and NCCL raise a plain ``RuntimeError`` whose message is
the only signal (``PEER_SYMPTOMS``); the project's own collectives (``hybrid.comm.shm``) mark theirs with
the kind instead (``hybrid.errors.of_kind``).
"""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from typing import Iterator, Mapping, Optional

from hybrid.errors import FailureKind, marked_kind

_lock = threading.Lock()
_state = {"entered": 0, "inside": None, "since": None, "last": time.time()}


@contextmanager
def collective(label: str) -> Iterator[None]:
    """Mark this process as inside collective ``label`` for the duration of the block."""
    now = time.time()
    with _lock:
        _state.update(entered=_state["entered"] + 1, inside=label, since=now, last=now)
    try:
        yield
    finally:
        with _lock:
            _state.update(inside=None, since=None, last=time.time())


# What gloo and NCCL say (in a RuntimeError, or torch's DistBackendError, a subclass) when the other end of a
# collective went away or never came: gloo's TCP pair seeing the peer's socket close or reset, gloo's timeout
# on a receive or on the pair, NCCL's watchdog timing out a collective and the communicator it then aborts.
PEER_SYMPTOMS = ("Connection closed by peer", "Connection reset by peer", "Timed out waiting",
                 "Application timeout caused pair closure", "Watchdog caught collective operation timeout",
                 "NCCL communicator was aborted")


def lost_peer(err: BaseException) -> bool:
    """Whether ``err`` is a collective's failure caused by a peer: marked ``FailureKind.PEER`` where it was
    raised (``hybrid.comm.shm``), or a ``RuntimeError`` saying one of ``PEER_SYMPTOMS`` (gloo's, NCCL's).
    Only ``err`` itself is looked at, not the exceptions it was raised from."""
    if marked_kind(err) is not None:
        return marked_kind(err) is FailureKind.PEER
    return isinstance(err, RuntimeError) and any(symptom in str(err) for symptom in PEER_SYMPTOMS)


def snapshot() -> dict:
    """The heartbeat as plain data, safe to read from another thread and to pickle."""
    with _lock:
        return dict(_state)


def reset() -> None:
    """Start counting afresh (a new attempt in the same process)."""
    with _lock:
        _state.update(entered=0, inside=None, since=None, last=time.time())


def hung_rank(beats: Mapping[int, dict], now: float, timeout_s: float) -> Optional[int]:
    """The rank its peers most likely timed out waiting for, or None when no rank stands out.

    ``beats`` maps rank → its last snapshot, with ``step`` (optimizer steps done) added by the caller.
    A candidate is outside every collective and has entered none for at least half the collective timeout
    (its peers waited a full timeout, so it stopped before they gave up). The one furthest behind by
    (step, collectives entered) is blamed, but only when it is strictly behind every other rank: equal
    progress means the snapshots cannot tell a cause from a victim.
    """
    if len(beats) < 2:
        return None
    progress = {rank: (beat.get("step", 0), beat["entered"]) for rank, beat in beats.items()}
    laggard = min(progress, key=lambda r: (progress[r], r))
    if any(progress[r] <= progress[laggard] for r in progress if r != laggard):
        return None
    beat = beats[laggard]
    if beat["inside"] is not None or now - beat["last"] < timeout_s / 2:
        return None
    return laggard
