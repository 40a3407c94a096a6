"""Sharded, atomic, resharding checkpoints of a ZeRO engine (torch.distributed.checkpoint underneath).

The per-rank training loop calls, on every rank::

    resumed = checkpoint.resume_if_available(run_dir, engine)     # None on a fresh run
    start = resumed.step if resumed else 0                        # data position: resumed.extra
    for step in range(start + 1, steps + 1):
        ...train one step...
        checkpoint.maybe_save(run_dir, engine, step, every, keep_last, extra={...},
                              model_config=cfg, force=(step == steps))

Offline (one process, no process group): ``consolidate(path)`` → the single-process fp32 state dict;
``describe(run_dir)`` → every checkpoint with its status, step, layout and size. Errors a user can fix
(not a checkpoint, another model, another TP degree) are ``hybrid.errors.CheckpointError``.

Modules: ``layout`` (directories, atomic publish, pruning), ``manifest`` (hybrid.json and the same-model
check), ``flat_planner`` (DCP planners for ZeRO's flat pieces), ``sharded`` (save/load on the engine),
``offline`` (consolidate/describe), ``rng`` (per-rank RNG states).
"""

from hybrid.checkpoint.layout import latest
from hybrid.checkpoint.offline import consolidate, describe
from hybrid.checkpoint.sharded import Resumed, load, maybe_save, resume_if_available, save

__all__ = ["Resumed", "consolidate", "describe", "latest", "load", "maybe_save", "resume_if_available", "save"]
