"""A failed rank's traceback, kept in the run directory so that the terminal shows one sentence.

A failure the user can act on (a ``hybrid.errors.JobError``: a checkpoint directory that filled up, a run that
diverged) says all in its sentence; the rank's traceback -- Ray's, with the library frames beneath it, dozens
of lines -- is for whoever digs further. ``keep(run_dir, rank, err)`` writes it to
``RUN_DIR/logs/rank-N-traceback.txt`` and returns that path (None without a run directory, or where it cannot
be written: the sentence then stands alone); ``pointing(sentence, path)`` is the sentence naming it.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Optional

log = logging.getLogger(__name__)

LOGS = "logs"


def keep(run_dir, rank: int, err: BaseException) -> Optional[Path]:
    """Write ``err`` as the driver received it (a Ray task error carries the rank's traceback) under ``run_dir``."""
    if run_dir is None:
        return None
    path = Path(run_dir) / LOGS / f"rank-{rank}-traceback.txt"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"{err}\n")
    except OSError as exc:
        log.debug("could not keep rank %d's traceback in %s (%s)", rank, path, exc)
        return None
    return path


def pointing(sentence: str, path: Optional[Path]) -> str:
    """``sentence`` ending with where the traceback is (unchanged without one)."""
    return sentence if path is None else f"{sentence.rstrip('.')}; the rank's traceback: {path}"
