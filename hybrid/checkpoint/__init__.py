"""Sharded, atomic, resharding checkpoints of a ZeRO engine (torch.distributed.checkpoint underneath).

The per-rank training loop calls, on every rank::

    with checkpoint.exclusive(run_dir, engine):                  # no second job writes here meanwhile
        resumed = checkpoint.resume_if_available(run_dir, engine) # None on a fresh run
        start = resumed.step if resumed else 0                    # data position: resumed.extra
        for step in range(start + 1, steps + 1):
            ...train one step...
            checkpoint.maybe_save(run_dir, engine, step, every, keep_last, extra={...},
                                  model_config=cfg, force=(step == steps))

Every file of a checkpoint is checksummed at save; a resume verifies the newest checkpoint first and falls
back to the newest good one (``on_skip`` hears about each one skipped), rank 0 choosing for every rank;
checkpoints that are all damaged, or a file that cannot be read, stop it (``CheckpointError``) rather than
let a fresh start overwrite them.

Offline (one process, no process group): ``consolidate(path)`` → the single-process fp32 state dict (a
damaged checkpoint or a non-finite tensor is refused); ``consolidate_hf(path, out_dir, max_shard_size=...)``
→ the same weights as a Hugging Face ``save_pretrained`` directory (sharded safetensors, their index, the
model's config.json), streamed a tensor at a time; ``describe(run_dir)`` → every checkpoint with its
status (verified), step, layout and size. Errors a user can fix (not a checkpoint, a damaged one, another
model, another TP degree) are ``hybrid.errors.CheckpointError``.

Modules: ``layout`` (directories, atomic publish, pruning), ``lock`` (one job per directory), ``manifest`` (hybrid.json and the same-model
check), ``integrity`` (checksums, the marker's seal, verification), ``agreement`` (the ranks' collective
checksums and choice of checkpoint), ``flat_planner`` (DCP planners for ZeRO's flat pieces), ``sharded``
(save/load on the engine), ``background`` (asynchronous saves from a host copy), ``cadence`` (when a run
saves), ``write_errors`` (a failed write's cause in one sentence), ``offline`` (consolidate/describe),
``hf_export`` (consolidate_hf), ``rng`` (per-rank RNG states).
"""

import importlib

# Imported on first use (PEP 562): ``torch.distributed.checkpoint`` (DTensor, sympy) costs ~0.75 s and ~50 MB
# of RSS per process, which a rank that never saves or loads should not pay.
_WHERE = {"CheckpointDamaged": "integrity", "Problem": "integrity", "latest": "layout", "consolidate": "offline",
          "consolidate_hf": "hf_export", "describe": "offline", "exclusive": "sharded", "Resumed": "sharded", "load": "sharded", "maybe_save": "sharded",
          "resume_if_available": "sharded", "save": "sharded"}

__all__ = sorted(_WHERE)


def __getattr__(name: str):
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'hybrid.checkpoint' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"hybrid.checkpoint.{module}"), name)
    globals()[name] = value
    return value
