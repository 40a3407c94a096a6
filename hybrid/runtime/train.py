"""The per-rank side of a job: the ``Context`` handed to an entrypoint, and the training-loop pieces.

An entrypoint is a function ``train(ctx)``. ``ctx`` carries the rank's 2D mesh, the model config (the
parsed YAML and its path), the job settings (steps, micro-batch, precision, ZeRO stage, checkpoint
directory and cadence, the cluster file's ``parallel.tp_plan``), the step counter, ``parallelize(model)``
(the model split over the rank's TP group by that plan or a Hugging Face model's own: ``hybrid.tp.plan``),
``report(metrics)``, ``should_stop()`` (this rank asked to stop) and ``stop_agreed()`` (any rank asked, agreed by
all: what a loop checks before each step). Reports go to an injected ``reporter`` callable (the launcher's; without
one they are logged), so this module stays free of Ray and runs under torchrun or ``run_local`` just as well.

The loop is split into one function per concern -- ``train_step`` (forward, backward, optimizer step;
the loss is the forward's output, or its ``.loss`` / ``["loss"]`` for a Hugging Face style model),
``step_metrics`` (what a step reports; ``run_steps`` adds the step's ZeRO bytes per link and the error of its
int8 collectives, ``hybrid.runtime.link_metrics``), ``resume`` and ``save_checkpoint`` (``hybrid.checkpoint`` on the
job's checkpoint directory) and ``run_steps`` (the loop, with a hook after every step). Held-out evaluation is
``hybrid.runtime.evaluate``'s (``run_steps(..., evaluate=Evaluation(...))``): its ``eval_loss``, ``eval_ppl`` and
``eval_time_s`` go into the report of the step they follow.

Checkpoints: when the job has a checkpoint directory, ``run_steps`` holds its lock for the whole run (rank 0;
a second job on the same directory is refused, ``hybrid.checkpoint.lock``), first has every rank load the
newest good checkpoint there (rank 0 chooses, the ranks verify its checksums; reported as ``resumed_from``,
with the damaged or interrupted ones skipped; checkpoints that are all damaged stop the job, exit 2, rather
than be overwritten by a fresh start) and continues from its step; after every step it
saves every ``checkpoint_every`` steps (or ``checkpoint_every_seconds``) and at the last step, with
``checkpoint_async`` in the background while training goes on (rank 0 reports ``checkpoint_saved``, with
the save's bytes and stall, once it is published; the run waits for the last write before it returns). The
data position saved is the step itself: ``batches(step)`` must yield the same batch for the same step on
every run, so a resumed run continues exactly as an uninterrupted one would. A step is one optimizer step:
with ``gradient_accumulation_steps`` k the step's rows are cut into k micro-batches (``train_step``).

Memory: after each of the first 3 steps of an attempt, then every ``measure_every`` steps, the step's
report carries ``memory_measured`` (``hybrid.plan.budget.MemoryMeter.measure``, baseline taken when the
``Context`` was made, before the engine); then the budget check raises ``torch.OutOfMemoryError`` when the
measured peak exceeds ``memory_budget_bytes`` (the driver re-plans). The checkpoint of that step is not
written, so the last good one is the one before.
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Optional

import torch

from hybrid import checkpoint

from hybrid.comm import heartbeat
from hybrid.errors import ConfigError, UserError
from hybrid.plan.budget import MemoryMeter, should_measure
from hybrid.runtime.link_metrics import LinkMeter
from hybrid.config.validate import DEFAULT_PRECISION

log = logging.getLogger(__name__)


class TrainError(UserError, TypeError):
    """The model or the batches do not fit the training loop (e.g. a forward with no loss to back-propagate)."""


class AccumulationMismatch(UserError, ValueError):
    """The job's gradient accumulation does not fit the engine or the batch: the engine was built with
    another ``gradient_accumulation_steps``, or a step's rows do not split into that many micro-batches."""


@dataclass(frozen=True)
class JobSettings:
    """The job's knobs as the launcher resolved them (the ZeRO stage is the plan's, never 'auto')."""

    steps: int
    micro_batch: int
    stage: int
    precision: str = DEFAULT_PRECISION
    seed: int = 0
    checkpoint_dir: Optional[str] = None
    checkpoint_every: int = 0
    checkpoint_keep_last: int = 2
    checkpoint_every_seconds: Optional[float] = None  # also save once this many seconds passed since the last save
    checkpoint_async: bool = False  # write checkpoints in the background from a host copy (hybrid.checkpoint.background)
    offload: Any = False  # optimizer states off the GPU (the plan's choice): False, True (host memory) or "nvme"
    nvme_path: Optional[str] = None  # offload "nvme": the node-local directory of the swap files (cluster.nvme_path)
    activation_checkpointing: bool = False  # recompute activations in backward (the plan's choice)
    gradient_accumulation_steps: int = 1  # micro-steps per step; each takes micro_batch / this rows
    memory_budget_bytes: Optional[float] = None  # the rank's budget (None: the GPU's total; CPU: none)
    measure_every: int = 10  # memory measured after each of the first steps, then every this many
    tp_plan: Optional[dict] = None  # parallel.tp_plan: module-name pattern -> TP style (Context.parallelize)
    zero_links: Optional[dict] = None  # the plan's ZeRO link options as zero keys (shard_group, hierarchical, ...)

    def as_dict(self) -> dict:
        return asdict(self)


def rank_seed(seed: int, dp_rank: int) -> int:
    """The seed of DP rank ``dp_rank``'s global generator for ``job.seed``: distinct per rank, reproducible."""
    return (seed * 1_000_003 + dp_rank) % (1 << 63)


class Context:
    """What one rank's entrypoint gets: mesh, configs, step counter, ``report`` and ``should_stop``."""

    def __init__(self, mesh, model_config: dict, settings: JobSettings, *, model_config_path: Optional[str] = None,
                 rank: int = 0, world_size: int = 1, device: str = "cpu",
                 reporter: Optional[Callable[[dict], None]] = None,
                 stop_requested: Optional[Callable[[], bool]] = None, model_config_origin: Optional[str] = None,
                 local_path: Optional[Callable[[str], str]] = None):
        self.mesh = mesh
        self.model_config = model_config
        self.model_config_path = model_config_path  # the file this rank read (a shipped copy, under Ray)
        # where the user's file is (on the driver): paths the model config names are relative to it
        self.model_config_origin = model_config_origin or model_config_path
        self._local_path = local_path
        self.settings = settings
        self.rank = rank
        self.world_size = world_size
        self.device = torch.device(device)
        self.step = 0  # optimizer steps completed (a resumed run starts above 0)
        self._reported_step = 0  # the step of the last report with a loss
        self.data_state: dict = {}     # what the entrypoint's data stream needs to continue: saved with each checkpoint
        self.resumed_extra: dict = {}  # what the checkpoint resumed from saved beside the model (``data_state``)
        self.checkpoints = None  # the run's saves (hybrid.runtime.checkpointing.RunCheckpoints), from the first
        self._reporter = reporter
        self._stop_requested = stop_requested
        # Made before the entrypoint builds the engine: the baseline of every measurement.
        self.memory_meter = MemoryMeter(self.device, settings.memory_budget_bytes)
        # torch's global generator (dropout, user code) from job.seed, one stream per DP rank (TP ranks of a
        # group compute replicated activations, so they share it); a resume then restores the saved state.
        torch.manual_seed(rank_seed(settings.seed, getattr(mesh, "dp_rank", rank)))

    def parallelize(self, model: torch.nn.Module) -> torch.nn.Module:
        """``model`` split over this rank's TP group (``ctx.mesh.tp_comm``) by the job's ``parallel.tp_plan``, else,
        under TP > 1, by a Hugging Face model's own plan (``hybrid.tp.parallelize``): what the launcher planned
        the TP degree for. Call it on the built model (on meta or not) before ``hybrid.initialize``. A model
        split already (``hybrid.tp`` layers, or a plan its ``build_model`` applied) is returned as it is, and so
        is one without a plan (TP 1); a plan that cannot be applied is one ``ConfigError`` sentence."""
        from hybrid.tp.hf import hf_plan, parallelize
        from hybrid.weights.attrs import is_tensor_parallel

        from hybrid.config.tp_plan import OWN

        plan = None if self.settings.tp_plan == OWN else self.settings.tp_plan  # own: the model's plan, below
        if any(is_tensor_parallel(p) for p in model.parameters()):
            if plan is not None:
                raise ConfigError(f"parallel.tp_plan is set, but the {type(model).__name__} to split has "
                                  "tensor-parallel parameters already (hybrid.tp layers, or a plan applied in "
                                  "build_model); remove parallel.tp_plan or build the model without them.")
            return model
        if plan is None and (getattr(self.mesh, "tp", 1) == 1 or hf_plan(model) is None):
            return model
        return parallelize(model, self.mesh.tp_comm, plan, "parallel.tp_plan")

    def local_path(self, path) -> Path:
        """Where this rank sees a file the driver calls ``path``: inside the copy of ``job.working_dir``
        shipped to its node when it lies in that directory (and was shipped), else ``path`` itself."""
        return Path(self._local_path(str(path)) if self._local_path is not None else path)

    @property
    def steps(self) -> int:
        return self.settings.steps

    @property
    def stage(self) -> int:
        return self.settings.stage

    def report(self, metrics: dict) -> None:
        """Send ``metrics`` (plain numbers, strings, dicts; tensors become numbers or lists) to the driver,
        tagged with rank, mesh and step. A report with ``loss`` is a step's (the driver's progress line and
        metrics.jsonl): its ``loss`` must be a number (a float or a one-element tensor); ``step_time_s``,
        ``lr``, ``grad_norm`` are optional (``step_metrics`` fills them). Its step is ``metrics["step"]``, else
        ``ctx.step`` (``run_steps`` advances it), and where that is not past the last reported step (a loop
        that leaves ``ctx.step`` alone) the step after it; ``ctx.step`` is then that step."""
        if not isinstance(metrics, Mapping):
            raise TrainError(f"ctx.report() takes a dict of metrics, got {type(metrics).__name__}; pass e.g. "
                             "{'loss': loss.item()}")
        metrics = _plain(dict(metrics))
        loss = metrics.get("loss", 0.0)
        if "loss" in metrics and (isinstance(loss, bool) or not isinstance(loss, (int, float))):
            raise TrainError(f"ctx.report(): 'loss' must be a number (a float or a one-element tensor), got "
                             f"{type(loss).__name__} {str(loss)[:40]!r}; report the step's loss, e.g. loss.item()")
        step = metrics.pop("step", self.step)
        if "loss" in metrics:
            if isinstance(step, bool) or not isinstance(step, int) or step <= self._reported_step:
                step = self._reported_step + 1  # a loop that does not count its steps in ctx.step: the next one
            self.step = self._reported_step = step
        record = {"rank": self.rank, "step": step, "time": time.time(),
                  "dp_rank": getattr(self.mesh, "dp_rank", 0), "tp_rank": getattr(self.mesh, "tp_rank", 0),
                  **metrics}
        if self._reporter is not None:
            self._reporter(record)
        else:
            log.info("rank %d step %d: %s", self.rank, step, metrics)

    def should_stop(self) -> bool:
        """True once the driver asked this rank to stop (Ctrl-C, another rank failed, an elastic resize): this
        rank's own flag, which reaches the ranks at different moments."""
        return bool(self._stop_requested and self._stop_requested())

    def stop_agreed(self) -> bool:
        """Whether any rank has been asked to stop, agreed by all: a one-element all-reduce (MAX) over every rank,
        so every rank leaves its loop before the same step (one rank stopping a step early would leave its peers
        in that step's collectives until they time out). Call it on every rank at the same point of the loop, as
        ``run_steps`` does before each step; a single process answers ``should_stop``."""
        import torch.distributed as dist

        flag = self.should_stop()
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return flag
        agreed = torch.tensor([int(flag)], dtype=torch.int32)  # CPU: gloo in every default group
        with heartbeat.collective("world.stop"):
            dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
        return bool(agreed.item())


# ---------------------------------------------------------------------------------------- loop pieces


def train_step(engine, *args, accumulation: int = 1, **kwargs) -> float:
    """One optimizer step: forward ``engine(*args, **kwargs)``, backward and ``engine.step()``; returns the
    rank's loss. With ``accumulation`` > 1 every tensor argument's rows are cut into that many equal
    micro-batches, each a forward, backward and ``engine.step()`` (the engine's
    ``gradient_accumulation_steps`` must match), and the loss is the mean over them.

    The forward may return the loss (a scalar tensor) or, in the Hugging Face style, an object with a
    ``.loss`` attribute (a ``ModelOutput``, any dataclass) or a mapping with a ``"loss"`` key.

    Raises ``AccumulationMismatch`` (a ``UserError``) before any forward when ``accumulation`` is not the
    engine's ``config.gradient_accumulation_steps`` (the engine would step its optimizer a different number
    of times per step) or the batch's rows do not split into ``accumulation`` equal micro-batches."""
    check_accumulation(engine, accumulation)
    total = None  # summed on the loss's device: one host sync per step, not one per micro-step
    for micro_args, micro_kwargs in _micro_batches(args, kwargs, accumulation):
        loss = loss_of(engine(*micro_args, **micro_kwargs))
        engine.backward(loss)
        engine.step()
        value = loss.detach().float()
        total = value if total is None else total + value
    return float(total) / accumulation


def engine_accumulation(engine) -> Optional[int]:
    """The engine's ``config.gradient_accumulation_steps`` (None for an engine without one, e.g. a test double)."""
    value = getattr(getattr(engine, "config", None), "gradient_accumulation_steps", None)
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def check_accumulation(engine, accumulation: int) -> None:
    """Raise ``AccumulationMismatch`` (one sentence naming both fields and the fix) when the job's
    ``accumulation`` is not the engine's ``config.gradient_accumulation_steps``; an engine without that field
    passes. A mismatch would silently run accumulation / engine's value optimizer steps per step."""
    built = engine_accumulation(engine)
    if built is None or built == accumulation:
        return
    raise AccumulationMismatch(
        f"job.gradient_accumulation_steps is {accumulation} but the engine's config has "
        f"gradient_accumulation_steps = {built}; build the engine's config from the job settings with "
        f"hybrid.models.gpt.training.training_config(..., accumulation=ctx.settings.gradient_accumulation_steps).")


def _micro_batches(args: tuple, kwargs: dict, accumulation: int):
    """``accumulation`` equal row slices of every tensor in ``args`` / ``kwargs`` (other values as they are)."""
    if accumulation == 1:
        return [(args, kwargs)]
    rows = batch_rows(args, kwargs)
    if rows % accumulation:
        raise AccumulationMismatch(
            f"a step's batch has {rows} rows, which do not split into job.gradient_accumulation_steps = "
            f"{accumulation} equal micro-batches; make batches(step) return job.micro_batch x "
            f"job.gradient_accumulation_steps rows per rank (as hybrid.models.gpt.training.train does).")
    n = rows // accumulation

    def cut(value, i):
        return value[i * n:(i + 1) * n] if isinstance(value, torch.Tensor) and value.dim() > 0 else value

    return [(tuple(cut(a, i) for a in args), {k: cut(x, i) for k, x in kwargs.items()})
            for i in range(accumulation)]


def loss_of(output) -> torch.Tensor:
    """The loss in a model's output: the output itself when it is a tensor, else its ``loss`` item or attribute."""
    if isinstance(output, torch.Tensor):
        loss = output
    elif isinstance(output, Mapping):
        loss = output.get("loss")
    else:
        loss = getattr(output, "loss", None)
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise TrainError(f"the model's forward returned {type(output).__name__} with no scalar loss "
                         f"(got {type(loss).__name__}); return the loss, or an output with .loss / ['loss'] "
                         f"(for a Hugging Face model, pass labels= in the batch).")
    return loss


def batch_args(batch) -> tuple:
    """``(args, kwargs)`` for the forward from what ``batches(step)`` returned: a mapping is keyword arguments
    (``{"input_ids": ..., "labels": ...}``), a tuple or list positional ones, anything else one argument."""
    if isinstance(batch, Mapping):
        return (), dict(batch)
    if isinstance(batch, (tuple, list)):
        return tuple(batch), {}
    return (batch,), {}


def batch_rows(args: tuple, kwargs: dict) -> int:
    """Rows of the batch: the first dimension of its first tensor (0 when it holds none)."""
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            return int(value.shape[0])
    return 0


def step_metrics(engine, loss: float, seconds: float, count: int, unit: str = "tokens") -> dict:
    """What a step reports: loss, learning rate, gradient norm (before clipping), step time, throughput --
    ``count`` items of ``unit`` ("tokens", "samples", ...) seen by the whole job in the step, reported under
    the unit's own key with ``throughput_unit`` --, the engine's memory report, and the non-finite guard:
    ``nonfinite`` (True when this step's global gradient norm was NaN/inf, so its update was skipped on
    every rank) and ``skipped_steps`` (how many steps this engine skipped so far)."""
    grad_norm = getattr(engine, "last_grad_norm", None)
    guard = getattr(engine, "nonfinite", None)
    metrics = {"loss": loss, "lr": getattr(engine, "lr", None),
               "grad_norm": None if grad_norm is None else float(grad_norm), "step_time_s": seconds,
               "throughput_unit": unit, unit: count, f"{unit}_per_s": count / seconds if seconds > 0 else 0.0,
               "memory": _plain(engine.memory_report())}
    if guard is not None:
        metrics.update(nonfinite=guard.consecutive > 0, skipped_steps=guard.skipped)
    return metrics


def stream_batches(ctx: Context, stream, rows: int) -> Callable[[int], tuple]:
    """``batches(step)`` for ``run_steps`` from a stream serving ``batch(step, rows, dp_rank, dp)`` (a
    ``hybrid.data.TokenFile``, the synthetic chain): this DP rank's ``rows`` of each step, on ``ctx.device``.
    A stream that can continue (``continue_from`` / ``data_state``: the token file) continues, at the first
    step after ``run_steps``' resume, from the position the checkpoint saved, and its position goes into every
    checkpoint (``ctx.data_state``): a resume that changes the rows per step (micro-batch, accumulation, DP
    size) reads on after the rows already read instead of re-reading or skipping some."""
    mesh, started = ctx.mesh, False

    def batches(step: int):
        nonlocal started
        if not started and hasattr(stream, "continue_from"):
            started = True
            if ctx.resumed_extra:
                stream.continue_from(ctx.resumed_extra.get("data_position", step), ctx.resumed_extra)
            ctx.data_state = stream.data_state(rows * mesh.dp)
        inputs, targets = stream.batch(step, rows, mesh.dp_rank, mesh.dp)
        return inputs.to(ctx.device), targets.to(ctx.device)

    return batches


def dp_mean(ctx: Context, value: float, what: str = "job_loss") -> float:
    """``value`` averaged over the DP ranks (one 8-byte all-reduce on the DP group, ``what`` names it to the
    heartbeat): every rank then reports the job's loss of a step, so the driver shows it exactly from any one
    rank's report -- also for a step whose other reports died with a rank's process before they reached the
    driver."""
    import torch.distributed as dist

    dp, group = getattr(ctx.mesh, "dp", 1), getattr(ctx.mesh, "dp_group", None)
    if dp <= 1 or not dist.is_initialized():
        return value
    total = torch.tensor([value], dtype=torch.float64)  # CPU: gloo in every default group (cpu:gloo,cuda:nccl)
    with heartbeat.collective(f"dp.{what}"):
        dist.all_reduce(total, group=group)
    return float(total) / dp


def resume(ctx: Context, engine) -> int:
    """Load the newest good checkpoint of the job's checkpoint directory into ``engine`` (every rank,
    together) and report it; returns the step to continue from (0 without a checkpoint).

    Newer checkpoints skipped on the way (interrupted, or a file missing, truncated or corrupt) are listed
    in the ``resumed_from`` report as ``skipped_checkpoints`` (``"step-000020 (corrupt: __1_0.distcp)"``).
    With only interrupted saves there, rank 0 reports ``checkpoint_warning`` (one sentence) and the run
    starts fresh; checkpoints that are all damaged raise ``CheckpointError`` on every rank (a fresh start
    would overwrite them)."""
    skipped = []
    run_dir = ctx.settings.checkpoint_dir
    resumed = checkpoint.resume_if_available(run_dir, engine, on_skip=lambda p, problem: skipped.append(
        f"{p.name} ({problem})"), model_config=ctx.model_config)
    if resumed is None:
        if skipped and ctx.rank == 0:
            warning = (f"no complete checkpoint in {run_dir} (only interrupted saves: {', '.join(skipped)}); "
                       f"starting fresh from step 0")
            log.warning("%s", warning)
            ctx.report({"checkpoint_warning": warning, "skipped_checkpoints": skipped})
        return 0
    ctx.step = resumed.step
    ctx.resumed_extra = dict(resumed.extra or {})
    ctx.report({"resumed_from": resumed.step, "checkpoint": str(resumed.path),
                "saved_world": resumed.saved_world, "skipped_checkpoints": skipped})
    return resumed.step


def save_checkpoint(ctx: Context, engine, step: int) -> Optional[str]:
    """After optimizer step ``step``: save when due (every ``checkpoint_every`` steps or
    ``checkpoint_every_seconds``, and at the last step; in the background with ``checkpoint_async``) on every
    rank together; rank 0 reports ``checkpoint_saved`` once a save is published, with its bytes and stall
    (``hybrid.runtime.checkpointing``). Returns the checkpoint's path when one was written or started."""
    if not ctx.settings.checkpoint_dir:
        return None
    if ctx.checkpoints is None:
        from hybrid.runtime.checkpointing import RunCheckpoints  # DCP: only for a run that saves

        ctx.checkpoints = RunCheckpoints(ctx, engine)
    return ctx.checkpoints.after_step(step)


def finish_checkpoints(ctx: Context) -> None:
    """At the end of a run that did not fail (every rank together): wait for a background save's write and
    report it; raises its failure (``CheckpointWriteError``)."""
    if ctx.checkpoints is not None:
        ctx.checkpoints.finish()


def run_steps(ctx: Context, engine, batches: Callable[[int], tuple], start_step: int = 0,
              tokens_per_step: int = 0, samples_per_step: int = 0,
              after_step: Iterable[Callable[[Context, Any, int], None]] = (), evaluate=None) -> dict:
    """Train from ``start_step`` (or the job's latest checkpoint) to ``ctx.steps``: fetch the step's batch,
    step, evaluate when due, report, save a checkpoint when due, then run each ``after_step(ctx, engine, step)``
    hook.

    ``evaluate``: a ``hybrid.runtime.evaluate.Evaluation`` (held-out batches and their cadence): after every
    step it is due at (``Evaluation.due``: every ``every`` steps and at step ``ctx.steps``), every rank computes
    the held-out loss without gradients and the step's report carries ``eval_loss`` (the DP mean), ``eval_ppl``
    and ``eval_time_s``; the step's ``step_time_s`` and its ZeRO bytes per link leave the evaluation out.

    ``batches(step)`` is called with the 0-based step index, which is also the data position a checkpoint
    records; it returns the forward's arguments: ``(inputs, targets)`` (any tuple: positional), or a dict
    of keyword arguments (a Hugging Face batch, ``{"input_ids": ..., "labels": ...}``). Throughput is
    counted in tokens when ``tokens_per_step`` (the whole job's) is given, else in samples:
    ``samples_per_step``, or the batch's rows times the DP degree. Returns a summary of the run.

    Raises ``AccumulationMismatch`` before loading a checkpoint or running a step when
    ``job.gradient_accumulation_steps`` is not the engine's ``config.gradient_accumulation_steps``, and
    ``CheckpointError`` (every rank) when another job holds the checkpoint directory or its checkpoints
    cannot be used (all damaged, unreadable, another model). The summary's ``eval_loss`` is the last
    evaluation's (None without one).
    """
    accumulation = ctx.settings.gradient_accumulation_steps
    check_accumulation(engine, accumulation)
    if not ctx.settings.checkpoint_dir:
        return _train_loop(ctx, engine, batches, start_step, tokens_per_step, samples_per_step, after_step, evaluate)
    with checkpoint.exclusive(ctx.settings.checkpoint_dir, engine):  # no other job writes here meanwhile
        start_step = resume(ctx, engine) or start_step
        return _train_loop(ctx, engine, batches, start_step, tokens_per_step, samples_per_step, after_step, evaluate)


def _train_loop(ctx: Context, engine, batches: Callable[[int], tuple], start_step: int, tokens_per_step: int,
                samples_per_step: int, after_step: Iterable[Callable[[Context, Any, int], None]], evaluate) -> dict:
    """``run_steps`` after the resume: steps ``start_step + 1`` to ``ctx.steps``; the run's summary."""
    accumulation = ctx.settings.gradient_accumulation_steps
    first_loss = last_loss = last_eval = None
    ctx.step = start_step
    if start_step >= ctx.steps and ctx.rank == 0:
        log.warning("step %d reached already (the checkpoint resumed from), at or past steps = %d: nothing left to "
                    "train; raise the steps to continue", start_step, ctx.steps)
    started = time.perf_counter()
    links = LinkMeter(engine)
    links.step()  # the baseline: what the build and the resume moved is not a step's
    for step in range(start_step, ctx.steps):
        if ctx.stop_agreed():
            log.info("rank %d: stop requested before step %d", ctx.rank, step + 1)
            break
        args, kwargs = batch_args(batches(step))
        t0 = time.perf_counter()
        loss = train_step(engine, *args, accumulation=accumulation, **kwargs)
        seconds = time.perf_counter() - t0
        ctx.step = step + 1
        if tokens_per_step:
            count, unit = tokens_per_step, "tokens"
        else:
            count, unit = samples_per_step or batch_rows(args, kwargs) * getattr(ctx.mesh, "dp", 1), "samples"
        metrics = {**step_metrics(engine, loss, seconds, count, unit), **links.step()}
        metrics["job_loss"] = dp_mean(ctx, loss)
        if evaluate is not None and evaluate.due(ctx.step, ctx.steps):
            metrics.update(evaluate.run(ctx, engine))
            last_eval = metrics["eval_loss"]
            links.step()  # the evaluation's gathers are no step's traffic
        measured = None
        if should_measure(ctx.step - start_step, ctx.settings.measure_every):
            measured = metrics["memory_measured"] = ctx.memory_meter.measure()
        ctx.report(metrics)
        if measured is not None:  # reported first, so the driver knows the figure the budget refused
            ctx.memory_meter.check(measured)
        first_loss = loss if first_loss is None else first_loss
        last_loss = loss
        save_checkpoint(ctx, engine, ctx.step)
        for hook in after_step:
            hook(ctx, engine, ctx.step)
    finish_checkpoints(ctx)
    return {"rank": ctx.rank, "start_step": start_step, "steps": ctx.step, "first_loss": first_loss,
            "last_loss": last_loss, "eval_loss": last_eval, "seconds": time.perf_counter() - started}


def _plain(value):
    """Make a report safe to ship to another process: tensors become numbers or lists, dataclasses dicts."""
    if isinstance(value, torch.Tensor):
        return value.item() if value.numel() == 1 else value.tolist()
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if hasattr(value, "__dataclass_fields__"):
        return _plain(asdict(value))
    return value
