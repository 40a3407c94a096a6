"""Save and load a ZeRO engine's training state with DCP; every rank writes and reads only what it owns.

What is saved, per parameter and TP rank: the fp32 master weights and the optimizer's per-element state
(both Adam moments, SGD's momentum buffer, ...: ``ShardView.states``), as flat tensors of the parameter's
TP-local numel (``manifest.tensor_key``); where they live (device or host memory, with optimizer offload, or an
NVMe swap file, read and filled a parameter piece at a time) does not matter, so a checkpoint saved with
offload resumes without it, on another offload device, and back. The manifest records the
optimizer class and its state keys (``optimizer``) and the learning-rate schedule (``scheduler``: its type,
parameters and the steps taken); a resume under another optimizer is refused in one sentence. Each DP
rank contributes the piece ``[start, end)`` it owns (``engine.shard_views()``); pieces that several DP
ranks hold identically (stage 0) are written once. The model's own (possibly bf16) trainable parameters are not saved: they are a
function of the masters and are rebuilt with ``engine.sync_params_from_master()`` after a load. The rest of
``module.state_dict()`` -- frozen parameters (requires_grad=False) and persistent buffers -- is
DP-replicated: DP rank 0 of each TP rank writes it as the module holds it, and every rank reads it back in
place. A tensor registered under several names (tied weights) is saved once, under its first name; the
manifest records the other names as aliases. Beside the tensors: every rank's RNG state, and rank 0's
manifest (step counters, world layout, names and shapes, model config, the caller's ``extra`` such as the
data position) with the size and crc32 of every file written (each rank digests its own files; the marker
seals the manifest: ``integrity``). Non-tensor module state (``get_extra_state``) is not saved.

Loading builds the *new* engine's pieces and lets DCP read the overlap of each with the saved pieces, so a
checkpoint written at one (DP size, ZeRO stage) resumes at any other with the same TP degree. RNG states
are restored only when the world layout is unchanged (a restart); under a new layout a rank's old stream
has no meaning. Rank 0 picks the checkpoint and the ranks verify its files together before any tensor is
read (``agreement.choose``): ``resume_if_available`` falls back to the newest good one, ``load`` refuses a
damaged one.

A save that cannot be written (disk full, quota, I/O error) fails on every rank together with
``CheckpointWriteError``: one sentence naming the cause (the disk's, where the error hides it:
``write_errors``) and the directory; the partial ``.tmp-step-N`` directory is removed (every rank's write had
returned) and the previous checkpoints stay as they were. ``save`` is ``prepare`` (this rank alone: the
manifest, the tensors) then ``write`` (collective over any group: the directory, the files, their checksums,
the publish), so ``background`` can run the write in a thread over a host copy while training goes on.

All ranks must call ``save`` / ``load`` / ``maybe_save`` / ``resume_if_available`` / ``exclusive``
together, and ``run_dir`` must be one directory that every rank sees (a shared filesystem across nodes).
``exclusive(run_dir, engine)`` holds the directory's lock (rank 0) so that no second job writes there.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

from hybrid.checkpoint import agreement, integrity, layout, manifest, rng, write_errors
from hybrid.checkpoint.flat_planner import FlatLoadPlanner, FlatSavePlanner, placeholder
from hybrid.comm.collectives import Comm
from hybrid.errors import CheckpointError, CheckpointWriteError, UsageError, first_line
from hybrid.weights.attrs import tensor_parallel_dim
from hybrid.weights.state_entries import BUFFER, state_dict_entries

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Resumed:
    """What a load restored, for the caller's loop: continue at ``step + 1`` with ``extra``."""

    path: Path
    step: int
    optimizer_step_count: int
    global_step: int
    extra: dict = field(default_factory=dict)
    saved_world: dict = field(default_factory=dict)
    rng_restored: bool = False


@dataclass(frozen=True)
class _World:
    rank: int
    world_size: int
    dp: int
    dp_rank: int
    tp: int
    tp_rank: int
    stage: int
    precision: str

    @classmethod
    def of(cls, engine) -> "_World":
        dp, tp = engine.dp_comm, engine.tp_comm  # tp_comm is None without a TP group
        return cls(rank=dist.get_rank(), world_size=dist.get_world_size(), dp=dp.size, dp_rank=dp.rank,
                   tp=1 if tp is None else tp.size, tp_rank=0 if tp is None else tp.rank,
                   stage=int(engine.stage), precision=str(engine.config.precision))

    def as_dict(self) -> dict:
        return {"world_size": self.world_size, "dp": self.dp, "tp": self.tp, "stage": self.stage,
                "precision": self.precision}


def _param_specs(engine, views: Mapping[str, Any]) -> dict:
    dims = {name: tensor_parallel_dim(p) for name, p in engine.module.named_parameters()}
    return manifest.param_specs({name: view.shape for name, view in views.items()}, dims)


@dataclass(frozen=True)
class _PlainState:
    """The module's state beside the ZeRO-managed parameters, by first ``state_dict`` name."""

    frozen: dict   # name -> frozen parameter
    buffers: dict  # name -> persistent buffer
    aliases: dict  # every other state_dict name of a tied tensor -> its first name

    @classmethod
    def of(cls, module: torch.nn.Module) -> "_PlainState":
        # A tensor goes by its first state_dict name, which for a parameter is its named_parameters() name
        # (the engine's); non-persistent buffer names are never saved, so they name nothing here.
        first, frozen, buffers, aliases = {}, {}, {}, {}
        for name, kind, tensor in state_dict_entries(module, extra=False):
            canonical = first.setdefault(id(tensor), name)
            if canonical != name:
                aliases[name] = canonical
            elif kind == BUFFER:
                buffers[name] = tensor
            elif not tensor.requires_grad:  # a trainable parameter is saved as the engine's master
                frozen[name] = tensor
        return cls(frozen, buffers, aliases)

    def specs(self, section: str) -> dict:
        tensors = getattr(self, section)
        return manifest.param_specs({n: t.shape for n, t in tensors.items()},
                                    {n: tensor_parallel_dim(t) for n, t in tensors.items()})

    def dcp_state(self, tp_rank: int) -> dict:
        """DCP key -> the live tensor (saving reads it, loading fills it in place)."""
        return {manifest.tensor_key(kind, tp_rank, name): tensor.detach()
                for section, kind in manifest.PLAIN_KINDS.items()
                for name, tensor in getattr(self, section).items()}


def _pieces(views: Mapping[str, Any], tp_rank: int) -> tuple[dict, dict, dict]:
    """``(state, where, swapped)``: this rank's non-empty pieces by DCP key, ``(start, param numel)`` of each, and
    the pieces kept in an NVMe swap file (``SwappedRange``, read and filled on demand by the planners; ``state``
    holds a placeholder of their length for them)."""
    state, where, swapped = {}, {}, {}
    for name in sorted(views):
        view = views[name]
        if view.end <= view.start:
            continue
        for kind, tensor in (("master", view.master), *view.states.items()):
            key = manifest.tensor_key(kind, tp_rank, name)
            if not isinstance(tensor, torch.Tensor):  # a SwappedRange
                swapped[key] = tensor
                tensor = placeholder(tensor.numel())
            state[key] = tensor
            where[key] = (int(view.start), int(view.numel))
    return state, where, swapped


def save(run_dir, engine, step: int, *, extra: Optional[Mapping[str, Any]] = None,
         model_config: Optional[Mapping[str, Any]] = None, keep_last: Optional[int] = None) -> Path:
    """Write ``RUN_DIR/checkpoints/step-NNNNNN`` atomically and return its path (collective).

    ``extra`` (JSON-serializable, rank 0's value is kept) comes back from ``load`` as ``Resumed.extra``;
    ``keep_last`` prunes older complete checkpoints (None keeps all).
    """
    return write(prepare(run_dir, engine, step, extra=extra, model_config=model_config), keep_last,
                 device=engine.device)


@dataclass
class Prepared:
    """A save up to its write: the manifest, the directories, and what each rank writes (``state``: DCP key ->
    tensor, or the rank's RNG state; ``pieces``/``swapped`` as the flat planner takes them)."""

    run_dir: Path
    step: int
    rank: int
    doc: dict
    tmp: Path
    final: Path
    state: dict
    pieces: dict
    swapped: dict


def prepare(run_dir, engine, step: int, *, extra: Optional[Mapping[str, Any]] = None,
            model_config: Optional[Mapping[str, Any]] = None) -> Prepared:
    """The first half of ``save``, on this rank alone (no collective): refuse a save with unsaved gradients,
    build the manifest and gather the live tensors the rank writes."""
    pending = engine.unsaved_gradients()
    if pending is not None:
        raise UsageError(f"cannot save a checkpoint now: {pending}, and a checkpoint holds no gradients, so a "
                         "resume from it would drop them; save right after an engine.step() that returned True")
    world = _World.of(engine)
    views = engine.shard_views()
    plain = _PlainState.of(engine.module)
    doc = manifest.build(step=step, optimizer_step_count=engine.optimizer_step_count,
                         global_step=engine.global_step, world=world.as_dict(),
                         params=_param_specs(engine, views), frozen=plain.specs("frozen"),
                         buffers=plain.specs("buffers"), aliases=plain.aliases, model_config=model_config,
                         extra=extra, optimizer=_optimizer_doc(engine))
    doc["saved_at"] = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    if engine.base_lr != engine.config.optimizer.lr:  # set by hand (engine.lr = x): the resume restores it
        doc["lr_set_by_hand"] = engine.base_lr
    tmp, final = layout.temporary_dir(run_dir, step), layout.final_dir(run_dir, step)
    state, pieces, swapped = _pieces(views, world.tp_rank)
    if world.dp_rank == 0:  # DP-replicated: one writer per TP rank, so the saved values are DP rank 0's
        state.update(plain.dcp_state(world.tp_rank))
    state[manifest.rng_key(world.rank)] = rng.capture()
    return Prepared(Path(run_dir), step, world.rank, doc, tmp, final, state, pieces, swapped)


def write(prepared: Prepared, keep_last: Optional[int] = None, group=None, device="cpu") -> Path:
    """The second half of ``save`` (collective over ``group``, default the world): rank 0 creates the step's
    temporary directory afresh, every rank writes its files, the ranks agree on their checksums, rank 0
    publishes (manifest, seal, rename, prune); returns the checkpoint's path. A failure is one ``CheckpointWriteError`` on every rank, the partial directory removed.
    ``hybrid.checkpoint.background`` runs it in a thread, on a group of its own, over a host copy of the state."""
    p, everyone = prepared, Comm(group, name="checkpoint")
    failure = None
    if p.rank == 0:  # a crash may have left this step half-written; start it afresh
        try:
            layout.remove(p.tmp)
            p.tmp.mkdir(parents=True)
        except OSError as err:
            cause, fix = write_errors.write_cause(err, p.tmp.parent)
            failure = str(write_errors.write_failed(p.step, p.tmp, cause + " on rank 0", fix,
                                                    previous=layout.latest(p.run_dir), wrote=False))
    _fail_together(failure, everyone, device)  # also the barrier before anyone writes
    planner = FlatSavePlanner(p.pieces, p.swapped)
    try:
        metadata = dcp.save(p.state, storage_writer=FileSystemWriter(p.tmp), planner=planner, process_group=group)
    except dcp.api.CheckpointException as exc:  # raised on every rank, after every rank's write returned
        failure = ""  # rank 0 names the cause (before the removal frees the space) for every rank
        if p.rank == 0:
            cause, fix = _cause(exc, p.tmp)
            layout.remove(p.tmp)
            failure = str(write_errors.write_failed(p.step, p.tmp, cause, fix, previous=layout.latest(p.run_dir)))
    if failure is not None:  # raised outside the handler: DCP's multi-rank traceback is no part of the sentence
        _fail_together(failure, everyone, device)
    # dcp.save returned: every rank's data and .metadata are written
    files = agreement.record_checksums(p.tmp, metadata, planner.final_plan.items, everyone, device)
    failure = None
    if p.rank == 0:
        p.doc["files"] = files
        failure = _publish(p.run_dir, p.tmp, p.final, p.doc, keep_last)
    _fail_together(failure, everyone, device)
    log.info("rank %d: saved %s", p.rank, p.final)
    return p.final


def _publish(run_dir, tmp: Path, final: Path, doc: dict, keep_last: Optional[int]) -> Optional[str]:
    """Rank 0: write the manifest, seal, rename, prune; the failure's sentence when writing failed, else None.
    The partial temporary directory is removed on failure; published checkpoints are never touched then."""
    try:
        manifest.write(tmp, doc)
        layout.publish(tmp, final, integrity.seal_text(tmp, final.name))
    except Exception as exc:  # noqa: BLE001 -- whatever it is, the other ranks wait to hear of it
        cause, fix = write_errors.write_cause(exc, tmp)
        layout.remove(tmp)
        return str(write_errors.write_failed(layout.step_of(final), tmp, cause + " on rank 0", fix,
                                             previous=layout.latest(run_dir)))
    try:
        for gone in layout.prune(run_dir, keep_last, keep=final, good=integrity.looks_intact):
            log.info("pruned checkpoint %s", gone)
    except Exception as exc:  # noqa: BLE001 -- the checkpoint is saved; pruning is tidying
        log.warning("saved %s, but pruning older checkpoints failed (%s)", final, exc)
    return None


def _fail_together(failure: Optional[str], comm: Comm, device) -> None:
    """Raise rank 0's ``failure`` sentence (``CheckpointWriteError``) on every rank when it has one."""
    if agreement.any_rank(failure is not None, comm, device):
        raise CheckpointWriteError(agreement.broadcast_text(failure or "", comm, device))


def _cause(exc: "dcp.api.CheckpointException", directory: Path) -> tuple[str, str]:
    """The first rank's failure in a DCP exception, in words ("No space left on device on rank 1"), and
    the fix it calls for (``write_errors``: an OSError's first, else the disk's state)."""
    failures = sorted(exc.failures.items())
    if not failures:
        return write_errors.classify(None, "no detail", write_errors.disk_facts(directory))
    rank, (err, _) = next(((r, f) for r, f in failures if write_errors.error_errno(f[0]) is not None), failures[0])
    cause, fix = write_errors.write_cause(err, directory)
    return f"{cause} on rank {rank}", fix


@contextlib.contextmanager
def exclusive(run_dir, engine):
    """Hold ``run_dir``'s checkpoint lock (rank 0) for the block, so that no other job writes checkpoints
    there meanwhile (collective on entry). Every rank raises the same ``CheckpointError`` (exit 2) when
    another job holds it (naming the holder) or ``checkpoints/`` cannot hold checkpoints; re-entrant."""
    with agreement.exclusive(run_dir, _everyone(), engine.device):
        yield


def maybe_save(run_dir, engine, step: int, every: int, keep_last: Optional[int] = None, *,
               extra: Optional[Mapping[str, Any]] = None, model_config: Optional[Mapping[str, Any]] = None,
               force: bool = False) -> Optional[Path]:
    """``save`` when ``step`` is a multiple of ``every`` (or ``force``, e.g. the last step); else None.

    Nothing is saved without a ``run_dir`` or with ``every`` < 1 (unless forced).
    """
    if not run_dir or not (force or (every and every > 0 and step % every == 0)):
        return None
    return save(run_dir, engine, step, extra=extra, model_config=model_config, keep_last=keep_last)


def load(path, engine) -> Resumed:
    """Fill ``engine`` from a checkpoint (a run directory's latest, or a checkpoint directory); collective.

    Rank 0 resolves ``path`` and every rank loads its choice, after the ranks verified its files together
    (``agreement.choose``). Raises CheckpointError (one sentence, the same on every rank, before any rank
    reads a tensor) when ``path`` is not a complete checkpoint, is damaged (``CheckpointDamaged``: a file
    missing, truncated or corrupt) or holds another model or TP degree.
    """
    return _load(agreement.choose(path, _everyone(), engine.device, fallback=False), engine)


def resume_if_available(run_dir, engine,
                        on_skip: Optional[Callable[[Path, integrity.Problem], None]] = None,
                        model_config: Optional[Mapping[str, Any]] = None) -> Optional[Resumed]:
    """``load`` the newest good checkpoint of ``run_dir``, or return None when it has none (collective).
    With ``model_config`` (the run's model config document) its ``model:`` section must be the checkpoint's.

    Newer directories that are not good -- interrupted saves (no marker), a missing, truncated or corrupt
    file -- are skipped: each is logged (rank 0) and passed to ``on_skip(directory, problem)`` on every rank,
    newest first, so the caller can say so.
    """
    if not run_dir:
        return None
    choice = agreement.choose(run_dir, _everyone(), engine.device, fallback=True)
    for ckpt, problem in choice.skipped if on_skip is not None else ():
        on_skip(ckpt, problem)
    return _load(choice, engine, model_config) if choice.path is not None else None


def _optimizer_doc(engine) -> dict:
    """What the manifest says about the optimizer and the schedule (checked at a resume)."""
    sched = engine.config.scheduler
    return {"type": engine.optimizer.cls.__name__, "state": list(engine.optimizer.keys),
            "skipped_steps": engine.skipped_steps,  # parameters without a gradient in some steps: their step lags
            "scheduler": None if sched is None else {"type": sched.type, "params": sched.values,
                                                     "steps_taken": engine.optimizer_step_count}}


def _everyone() -> Comm:
    return Comm(None, name="checkpoint")


def _unreadable_data(ckpt: Path, exc: "dcp.api.CheckpointException") -> CheckpointError:
    """One sentence for DCP's multi-rank traceback: a data file that passed the size check (a format-2
    checkpoint has no checksums) but does not decode."""
    rank, (error, _) = min(exc.failures.items())
    detail = first_line(error).split(". ")[0].rstrip(".")  # torch's unpickling advice runs on for lines
    return CheckpointError(f"{ckpt} is damaged: rank {rank} could not read its data ({type(error).__name__}: "
                           f"{detail}); {integrity.FIX}")


def _load(choice: "agreement.Choice", engine, model_config: Optional[Mapping[str, Any]] = None) -> Resumed:
    world = _World.of(engine)
    ckpt, doc = choice.path, choice.inventory.manifest
    manifest.check_same_model_config(doc, model_config, ckpt)
    views = engine.shard_views()
    plain = _PlainState.of(engine.module)
    manifest.check_same_model(doc, _param_specs(engine, views), world.tp, ckpt,
                              frozen=plain.specs("frozen"), buffers=plain.specs("buffers"))
    manifest.check_same_optimizer(doc, _optimizer_doc(engine), ckpt)

    state, pieces, swapped = _pieces(views, world.tp_rank)
    state.update(plain.dcp_state(world.tp_rank))
    saved = doc["world"]
    same_world = all(saved.get(k) == v for k, v in (("world_size", world.world_size), ("dp", world.dp),
                                                     ("tp", world.tp)))
    rng_key = manifest.rng_key(world.rank)
    if same_world:
        state[rng_key] = b""
    offsets = {key: start for key, (start, _) in pieces.items()}
    try:
        dcp.load(state, storage_reader=FileSystemReader(ckpt), planner=FlatLoadPlanner(offsets, swapped))
    except dcp.api.CheckpointException as exc:  # collective: every rank gets the same one
        raise _unreadable_data(ckpt, exc) from None
    if same_world:
        rng.restore(state[rng_key])
    engine.restore_optimizer(int(doc["optimizer_step_count"]), (doc.get("optimizer") or {}).get("skipped_steps", {}))
    engine.global_step = int(doc["global_step"])
    # The checkpoint's rate: one set by hand, else the configured one (a hand-set rate of the engine before
    # this load does not outlive it); also makes engine.lr the next step's rate.
    engine.lr = float(doc.get("lr_set_by_hand", engine.config.optimizer.lr))
    engine.sync_params_from_master()
    log.info("rank %d: resumed from %s (step %d)", world.rank, ckpt, doc["step"])
    return Resumed(path=ckpt, step=int(doc["step"]), optimizer_step_count=int(doc["optimizer_step_count"]),
                   global_step=int(doc["global_step"]), extra=dict(doc.get("extra") or {}),
                   saved_world=dict(saved), rng_restored=same_world)
