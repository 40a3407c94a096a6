"""A run's checkpoint saves, as ``run_steps`` makes them: when (``hybrid.checkpoint.cadence``: every
``checkpoint_every`` steps, every ``checkpoint_every_seconds``, the last step), how (synchronous, or with
``checkpoint_async`` in the background: ``hybrid.checkpoint.background``), and what rank 0 reports of each.

``RunCheckpoints(ctx, engine).after_step(step)`` (every rank, after each optimizer step) hands over a
background save that has finished, then saves when due; ``finish()`` (every rank, at the end of a run that
did not fail) waits for the write in flight. Each published save is one ``checkpoint_saved`` report of rank
0: the step and directory, ``checkpoint_bytes`` (every file), ``checkpoint_stall_s`` (how long training
stopped for it), ``checkpoint_write_s`` and ``checkpoint_async``. A background write's failure is raised
on every rank at the next save or at ``finish`` (``CheckpointWriteError``, one sentence).
"""

from __future__ import annotations

from typing import Optional

from hybrid.checkpoint import agreement, background, layout
from hybrid.checkpoint.cadence import Cadence
from hybrid.comm.collectives import Comm


class RunCheckpoints:
    """The saves of one run on one rank; see the module docstring."""

    def __init__(self, ctx, engine):
        s = ctx.settings
        self.ctx, self.engine = ctx, engine
        everyone = Comm(None, name="checkpoint")
        self.cadence = Cadence(s.checkpoint_every, s.checkpoint_every_seconds, ctx.steps,
                               agree=lambda flag: agreement.any_rank(flag, everyone, engine.device))
        self.saver = background.BackgroundSaver() if s.checkpoint_async else None

    def after_step(self, step: int) -> Optional[str]:
        """Save after optimizer ``step`` when due; the directory being written (or written), else None."""
        if self.saver is not None:
            self._report(self.saver.finished())
        if not self.cadence.due(step):
            return None
        s, extra = self.ctx.settings, {"data_position": step, **self.ctx.data_state}
        kwargs = dict(keep_last=s.checkpoint_keep_last, extra=extra, model_config=self.ctx.model_config)
        self.cadence.saved()
        if self.saver is None:
            record = background.synchronous(s.checkpoint_dir, self.engine, step, **kwargs)
            self._report([record])
            return str(record.path)
        self.saver.save(s.checkpoint_dir, self.engine, step, **kwargs)
        self._report(self.saver.finished())  # the previous one, and this one when written already (NVMe swap)
        return str(layout.final_dir(s.checkpoint_dir, step))

    def finish(self) -> None:
        """Wait for the background write in flight (every rank together) and report it."""
        if self.saver is not None:
            self.saver.close()
            self._report(self.saver.finished())

    def _report(self, records: list) -> None:
        for record in records if self.ctx.rank == 0 else ():
            self.ctx.report({"checkpoint_saved": record.step, "checkpoint": str(record.path),
                             "checkpoint_bytes": record.bytes, "checkpoint_stall_s": record.stall_s,
                             "checkpoint_write_s": record.write_s, "checkpoint_async": record.background})
