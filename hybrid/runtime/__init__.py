"""What runs in a rank around the engine: the entrypoint's ``Context`` and training loop, and the local runner.

- ``train``: ``Context``, ``run_steps``, ``stream_batches`` (also ``hybrid.train``).
- ``failure``: ``failure_kind(err)``, why the rank failed (``hybrid.errors.FailureKind``), for the launcher.
- ``local_launch``: ``run_local(fn, world_size)``, N local ranks with a real process group, no Ray and no
  torchrun (tests, examples, the GPU check).
- ``probe``: ``measure_rank``, this rank's link and compute figures for ``hybrid probe`` (the time model).
"""
