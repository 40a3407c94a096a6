"""User-facing errors: one clear sentence naming the field and the fix.

Library code raises a subclass of ``UserError`` for anything the user can fix (a bad config field, a
cluster that cannot hold the model, a file that is not a checkpoint). The CLI prints ``str(err)`` alone
and exits with status 2; it never shows a traceback for these. ``listing(names)`` is the one way a message
names several things, ``first_line(err)`` the one way it quotes another library's exception.
"""

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
