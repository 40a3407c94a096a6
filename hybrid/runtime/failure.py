"""Why a rank failed, decided on the rank: ``failure_kind(err)`` for what its entrypoint raised.

The launcher's rank actor (``launch.ray.workers``) catches what the entrypoint raised and sends the kind with
the error (``hybrid.errors.RankFailed``); the driver weighs the kinds of all failed ranks to name the cause
(``launch.job.driver``) and never reads an error's text to do it.

The kind, first match wins:

* ``EXITED`` -- ``SystemExit`` with a failing code (``sys.exit(3)``; code 0 or None is a success, not a failure);
* ``INTERRUPTED`` -- ``KeyboardInterrupt``;
* ``USER_ERROR``, ``JOB_ERROR``, ``OUT_OF_MEMORY`` -- by the error's own type: a ``hybrid.errors.UserError``, a
  ``JobError``, a ``torch.OutOfMemoryError`` (a GPU's, or the rank's memory budget check's);
* the kind the error was marked with where it was raised (``hybrid.errors.of_kind``);
* ``PEER`` -- the error, or one it was raised from or while handling (``raise ... from``, an error in an
  ``except`` or ``finally`` block), is a collective's failure caused by a peer (``hybrid.comm.heartbeat.lost_peer``).
  Recognised here, where the rank catches it, rather than in the collective wrapper: a collective's error also
  surfaces where no wrapper sees it (an async handle's ``wait()``, torch.distributed.checkpoint's own
  collectives, an entrypoint's own ``torch.distributed`` calls);
* ``RAISED`` otherwise.
"""

from __future__ import annotations

from typing import Iterator

from hybrid.comm.heartbeat import lost_peer
from hybrid.errors import FailureKind, JobError, UserError, marked_kind
from hybrid.plan.budget import OutOfMemoryError

_BY_TYPE = ((UserError, FailureKind.USER_ERROR), (JobError, FailureKind.JOB_ERROR),
            (OutOfMemoryError, FailureKind.OUT_OF_MEMORY))


def failure_kind(err: BaseException) -> FailureKind:
    """The ``FailureKind`` of ``err``, raised by a rank's entrypoint (see the module docstring)."""
    if isinstance(err, SystemExit):
        return FailureKind.EXITED
    if isinstance(err, KeyboardInterrupt):
        return FailureKind.INTERRUPTED
    for cls, kind in _BY_TYPE:
        if isinstance(err, cls):
            return kind
    marked = marked_kind(err)
    if marked is not None:
        return marked
    if any(lost_peer(e) for e in _chain(err)):
        return FailureKind.PEER
    return FailureKind.RAISED


def _chain(err: BaseException) -> Iterator[BaseException]:
    """``err`` and the exceptions it was raised from or while handling, newest first (each once)."""
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        yield err
        err = err.__cause__ if err.__cause__ is not None or err.__suppress_context__ else err.__context__
