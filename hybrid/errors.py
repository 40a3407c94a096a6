"""User-facing errors: one clear sentence naming the field and the fix.

Library code raises a subclass of ``UserError`` for anything the user can fix (a bad config field, a
cluster that cannot hold the model, a file that is not a checkpoint). The CLI prints ``str(err)`` alone
and exits with status 2; it never shows a traceback for these. ``listing(names)`` is the one way a message
names several things, ``first_line(err)`` the one way it quotes another library's exception.

Why a rank failed travels as data, not as text to search: ``FailureKind`` names it, the rank decides it
where it caught the exception (``hybrid.runtime.failure.failure_kind``), and ``RankFailed`` carries the kind
and the exception to the launcher, which weighs the kinds of all failed ranks to name the cause.
"""

import enum
import re
from typing import Optional

# gloo and other C++ libraries open their messages with the source location, "[.../pair.cc:537] "
_SOURCE_PREFIX = re.compile(r"^\[[^\]]*\.(cc|cpp|h|hpp):\d+\]\s*")


def listing(names, limit: int = 5) -> str:
    """``'a', 'b' and 3 more``: the first ``limit`` names, quoted, and how many are left out."""
    names = list(names)
    shown = ", ".join(repr(n) for n in names[:limit])
    more = len(names) - limit
    return shown + (f" and {more} more" if more > 0 else "")


def first_line(err, empty: str = "no detail", limit: Optional[int] = None) -> str:
    """The first line of ``err``'s message (an exception or a text; ``empty`` when it has none), without a C++
    source-location prefix, at most ``limit`` characters: a library's multi-line message or traceback quoted
    inside one sentence."""
    text = str(err).strip()
    return (_SOURCE_PREFIX.sub("", text.splitlines()[0]) if text else empty)[:limit]


def _rebuilt(cls, args: tuple, state: dict) -> Exception:
    err = cls.__new__(cls)
    err.args = args
    err.__dict__.update(state)
    return err


class _Portable(Exception):
    """An exception that crosses a process boundary whatever its ``__init__`` takes: a rank's error reaches the
    driver through pickle, which by default calls ``cls(*args)`` and so fails for a subclass whose
    constructor takes other arguments (the driver then got an unpickling error, not the sentence)."""

    def __reduce__(self):
        return _rebuilt, (type(self), self.args, dict(self.__dict__))


def reworded(err: Exception, message: str) -> Exception:
    """A copy of ``err`` (same class and attributes) whose message is ``message``."""
    return _rebuilt(type(err), (message,), dict(getattr(err, "__dict__", {})))


class FailureKind(str, enum.Enum):
    """Why a rank stopped. The rank decides the kinds of what it raised; the launcher adds ``DIED`` (the rank's
    process is gone) and ``HUNG`` (it raised nothing, and its heartbeat shows its peers timed out waiting for it)."""

    RAISED = "raised"                # the rank's own exception, none of the kinds below
    DIED = "died"                    # its process died (killed, crashed, os._exit)
    HUNG = "hung"                    # its peers timed out waiting for it in a collective
    EXITED = "exited"                # the entrypoint called sys.exit with a failing code
    INTERRUPTED = "interrupted"      # the entrypoint raised KeyboardInterrupt
    PEER = "peer"                    # a collective failed because a peer stopped or never came: a consequence
    USER_ERROR = "user_error"        # a UserError: one sentence, exit 2, never retried
    JOB_ERROR = "job_error"          # a JobError: a restart would only repeat it, exit 1
    OUT_OF_MEMORY = "out_of_memory"  # torch.OutOfMemoryError (a GPU's, or over the rank's memory budget)


def of_kind(err: BaseException, kind: FailureKind) -> BaseException:
    """``err`` marked as a failure of ``kind``, for code that raises an exception whose type must stay what it is
    (the ``RuntimeError`` of a collective) but knows why it fails; returns ``err``, to raise. The mark is an
    attribute, so it survives pickling."""
    err.failure_kind = kind
    return err


def marked_kind(err: BaseException) -> Optional[FailureKind]:
    """The kind ``of_kind`` marked ``err`` with, or None."""
    kind = getattr(err, "failure_kind", None)
    return kind if isinstance(kind, FailureKind) else None


class RankFailed(_Portable):
    """What a rank's entrypoint raised, as the rank reports it to the launcher: ``kind`` (a ``FailureKind``,
    decided on the rank) and ``error``, the exception itself (or a ``RuntimeError`` with its type and message
    where it cannot travel). Its message is the error's type and message."""

    def __init__(self, kind: FailureKind, error: BaseException):
        super().__init__(f"{type(error).__name__}: {error}")
        self.kind, self.error = FailureKind(kind), error


class UserError(_Portable):
    """An error the user can fix; its message is one sentence naming the field and the fix."""


class ConfigError(UserError, ValueError):
    """A configuration field (training config, cluster.yaml, DeepSpeed-style dict) is invalid."""


class UsageError(UserError, RuntimeError):
    """The library was used in a way it cannot honour (a step without a backward, a parameter frozen after
    ``hybrid.initialize``, a model another engine holds); the message names the right way."""


class LossError(UserError, TypeError):
    """``engine.backward`` was given something that is not the scalar loss of a forward with gradients."""


class PlanError(UserError):
    """The planner found no way to fit the model on the given cluster."""


class CheckpointError(UserError):
    """A path is not a usable checkpoint for this model."""


class JobError(_Portable):
    """The job failed in a way a restart would only repeat (its message is one sentence): the launcher does not
    retry it and exits 1."""


class CheckpointWriteError(JobError):
    """A checkpoint could not be written (disk full, quota, I/O error); the previous ones are intact."""


class NonFiniteError(JobError):
    """Training diverged: the global gradient norm stayed NaN or inf for too many consecutive steps."""


class DataError(UserError):
    """A data file (token file, text to tokenise, tokenizer) is missing, empty or malformed."""
