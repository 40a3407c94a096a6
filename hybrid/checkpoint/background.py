"""Asynchronous checkpoint saves: the rank copies what it writes to host memory and a background thread
writes it, while training goes on.

``BackgroundSaver.save(run_dir, engine, step, ...)`` (every rank together, right after an optimizer step)
first waits for the previous save's write, raising its failure (``CheckpointWriteError``, the same on every
rank) -- one save in flight at a time --; then ``sharded.prepare`` (the manifest, the live tensors: no
collective), copies every tensor into host buffers that the saver keeps from one save to the next (pinned
for a GPU's tensors: the master shard, the optimizer states, offloaded or not, the frozen parameters and
buffers), and starts a thread that runs ``sharded.write`` on that copy over a gloo process group of its own
(made at the first save: the only collective on the training thread), so the directory's creation, DCP's
collectives, the checksum agreement and the publish never interleave with training's. The stall of a save
is the wait for the previous one plus the manifest and the copy. The files are those a synchronous ``sharded.save`` of the same state writes, bit
for bit (same tensors, same planner); a checkpoint is still published only when every rank's files are
written and their checksums agreed, so a rank killed during a background write leaves the previous
checkpoint the latest.

A rank whose optimizer states live in an NVMe swap file (read on demand, rewritten by the next step) saves
synchronously: a host copy of what offload moved out of memory would not fit where it was moved from.

``finished()`` returns the saves whose write has finished, each once (for the report; a failure waits for
``wait``, so every rank raises it at the same point); ``wait()`` blocks for the write in flight, or raises
its failure; ``close()`` waits, then releases the saver's group. Call ``wait``/``close`` on every rank
together at the end of a run; after an exception elsewhere, leave the daemon thread alone (its peers may be
gone).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Mapping, Optional

import torch
import torch.distributed as dist

from hybrid.checkpoint import sharded
from hybrid.comm.shm import _group_timeout

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SaveRecord:
    """One save: its step and directory, the checkpoint's bytes (rank 0's count of every file; 0 on other
    ranks), this rank's stall (training stopped for it) and the write's seconds (in the background when
    ``background``)."""

    step: int
    path: Path
    bytes: int
    stall_s: float
    write_s: float
    background: bool


def checkpoint_bytes(prepared: "sharded.Prepared") -> int:
    """The bytes of every file of a written save (rank 0, which holds the manifest's ``files``)."""
    return sum(int(f["bytes"]) for f in prepared.doc.get("files", {}).values())


def synchronous(run_dir, engine, step: int, *, keep_last: Optional[int], extra: Optional[Mapping[str, Any]],
                model_config: Optional[Mapping[str, Any]]) -> SaveRecord:
    """``sharded.save`` with its record: the whole save is the stall."""
    t0 = time.perf_counter()
    prepared = sharded.prepare(run_dir, engine, step, extra=extra, model_config=model_config)
    path = sharded.write(prepared, keep_last, device=engine.device)
    seconds = time.perf_counter() - t0
    return SaveRecord(step, path, checkpoint_bytes(prepared), seconds, seconds, background=False)


class BackgroundSaver:
    """One rank's asynchronous saves; see the module docstring."""

    def __init__(self):
        self._group = None
        self._buffers: dict = {}  # DCP key -> host buffer, reused by the next save of the same shape
        self._thread: Optional[threading.Thread] = None
        self._outcome: Any = None  # the finished write's SaveRecord, or its exception
        self._done: list = []  # finished saves not yet handed over by ``finished``

    def save(self, run_dir, engine, step: int, *, keep_last: Optional[int] = None,
             extra: Optional[Mapping[str, Any]] = None,
             model_config: Optional[Mapping[str, Any]] = None) -> float:
        """Start saving ``step`` (collective); returns this rank's stall in seconds. A save the rank cannot
        copy (NVMe swap) is written before it returns, and ``finished`` hands it over like any other."""
        t0 = time.perf_counter()
        self.wait()
        prepared = sharded.prepare(run_dir, engine, step, extra=extra, model_config=model_config)
        if getattr(engine.optimizer, "swap", None) is not None:  # the job's choice, so every rank's alike
            path = sharded.write(prepared, keep_last, device=engine.device)
            stall = time.perf_counter() - t0
            self._done.append(SaveRecord(step, path, checkpoint_bytes(prepared), stall, stall, background=False))
            return stall
        prepared = replace(prepared, state=self._host_copy(prepared.state))
        if self._group is None:
            # collective: every rank's first save, together; the job's collective timeout, not torch's 30 min
            self._group = dist.new_group(backend="gloo", timeout=_group_timeout(dist.group.WORLD))
        stall = time.perf_counter() - t0
        self._thread = threading.Thread(target=self._write, args=(prepared, keep_last, stall),
                                        name=f"checkpoint-step-{step}", daemon=True)
        self._thread.start()
        return stall

    def _host_copy(self, state: dict) -> dict:
        staged, cuda = {}, False
        for key, value in state.items():
            if not isinstance(value, torch.Tensor):
                staged[key] = value
                continue
            buffer = self._buffers.get(key)
            if buffer is None or buffer.shape != value.shape or buffer.dtype != value.dtype \
                    or buffer.stride() != value.stride():
                buffer = torch.empty_like(value, device="cpu", pin_memory=value.is_cuda)
                self._buffers[key] = buffer
            buffer.copy_(value.detach(), non_blocking=value.is_cuda)
            cuda = cuda or value.is_cuda
            staged[key] = buffer
        if cuda:
            torch.cuda.synchronize()
        for key in set(self._buffers) - set(state):
            del self._buffers[key]
        return staged

    def _write(self, prepared: "sharded.Prepared", keep_last: Optional[int], stall: float) -> None:
        t0 = time.perf_counter()
        try:
            path = sharded.write(prepared, keep_last, group=self._group, device="cpu")
            self._outcome = SaveRecord(prepared.step, path, checkpoint_bytes(prepared), stall,
                                       time.perf_counter() - t0, background=True)
        except BaseException as exc:  # noqa: BLE001 -- handed to the training thread at its next wait
            log.debug("rank %d: background write of step %d failed", prepared.rank, prepared.step, exc_info=True)
            self._outcome = exc

    def pending(self) -> bool:
        """Whether a write is in flight."""
        return self._thread is not None and self._thread.is_alive()

    def finished(self) -> list:
        """The saves whose write finished since the last call (each once, for the report); never blocks.
        A failure stays for ``wait``, so every rank raises it at the same point."""
        if not self.pending() and isinstance(self._outcome, SaveRecord):
            self._done.append(self._outcome)
            self._outcome = None
        done, self._done = self._done, []
        return done

    def wait(self) -> None:
        """Block until the write in flight is done (``finished`` then has it), or raise its failure."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        outcome, self._outcome = self._outcome, None
        if isinstance(outcome, BaseException):
            raise outcome
        if outcome is not None:
            self._done.append(outcome)

    def close(self) -> None:
        """``wait``, then drop the host buffers and the saver's process group."""
        try:
            self.wait()
        finally:
            self._buffers.clear()
            if self._group is not None:
                dist.destroy_process_group(self._group)
                self._group = None
