"""Held-out evaluation inside a rank's loop: the loss on batches training never sees, without gradients.

``Evaluation(batches, count, every)`` is what ``hybrid.runtime.train.run_steps(..., evaluate=...)`` takes:
``batches(i)`` returns held-out batch ``i`` (``i`` in ``range(count)``, the same batches at every evaluation;
the forward's arguments, as ``run_steps``' own ``batches(step)`` returns them) and ``every`` is the cadence in
steps (0: only at the last step, which is always evaluated). ``Evaluation.run(ctx, engine)`` runs the forwards
under ``torch.no_grad()`` with the module in eval mode (each submodule's mode put back after), reads the loss
as ``train_step`` does (``loss_of``) and returns ``eval_loss`` -- the mean over the batches, averaged over the DP
ranks (one 8-byte all-reduce; TP ranks of a group compute the same loss) --, ``eval_ppl`` (its exponential,
the perplexity) and ``eval_time_s``. Nothing else changes: no backward, no ``engine.step()``, so the weights,
the gradients, the optimizer state and its step count are untouched. At ZeRO stage 3 the forward gathers each
unit as in training (``hybrid.zero.params``); under ``no_grad`` nothing is held for a backward, so every unit
is released when the forward ends. All DP ranks must evaluate together (the gathers and the mean are
collectives): ``run_steps`` evaluates at the same steps on every rank.

Memory: an evaluation is a forward of one batch at a time, ``job.micro_batch`` rows per rank for the built-in
loops, with no activations kept for a backward: less than a training micro-step, so the plan's memory model
(``hybrid.plan.memory``) needs nothing for it.

Held-out data for the built-in loops (``hybrid.models.sections.held_out_stream``): ``split_held_out`` cuts the
last ``fraction`` of a token file's windows off its training stream (``TokenFile(span=...)``: training then
never reads them) and serves them as a stream of their own; ``UnseenSteps`` serves a synthetic chain's
sequences at negative steps, which training (steps 0, 1, ...) never draws. ``stream_eval_batches`` turns such a
stream into ``Evaluation.batches``: this DP rank's ``rows`` of each held-out batch, checked to fit the held-out
windows.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch

from hybrid.errors import ConfigError
from hybrid.runtime.train import Context, batch_args, dp_mean, loss_of


@dataclass(frozen=True)
class Evaluation:
    """``count`` held-out batches (``batches(i)``), evaluated every ``every`` steps and at the last step."""

    batches: Callable[[int], Any]
    count: int = 1
    every: int = 0

    def __post_init__(self) -> None:
        for name, low in (("count", 1), ("every", 0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ConfigError(f"Evaluation.{name} is {value!r}; give a whole number >= {low}.")

    def due(self, step: int, last_step: int) -> bool:
        """Whether the evaluation runs after step ``step`` (1-based) of a run ending at ``last_step``."""
        return step == last_step or (self.every > 0 and step % self.every == 0)

    def run(self, ctx: Context, engine) -> dict:
        """The held-out loss of ``engine`` now, its DP mean on every rank: ``eval_loss``, ``eval_ppl``,
        ``eval_time_s``. A collective: every rank of the job calls it together."""
        started = time.perf_counter()
        total = None
        with torch.no_grad(), _eval_mode(engine):
            for i in range(self.count):
                args, kwargs = batch_args(self.batches(i))
                value = loss_of(engine(*args, **kwargs)).detach().float()
                total = value if total is None else total + value
        loss = dp_mean(ctx, float(total) / self.count, what="eval_loss")
        return {"eval_loss": loss, "eval_ppl": perplexity(loss), "eval_time_s": time.perf_counter() - started}


def perplexity(loss: float) -> float:
    """``exp(loss)`` (inf where it overflows a float)."""
    try:
        return math.exp(loss)
    except OverflowError:
        return math.inf


class _eval_mode:
    """The engine's module (or the engine itself, an ``nn.Module``) in eval mode, each submodule's mode restored."""

    def __init__(self, engine):
        module = engine if isinstance(engine, torch.nn.Module) else getattr(engine, "module", None)
        self.modes = {m: m.training for m in module.modules()} if isinstance(module, torch.nn.Module) else {}

    def __enter__(self):
        for m in self.modes:
            m.training = False

    def __exit__(self, *exc):
        for m, mode in self.modes.items():
            m.training = mode


# ------------------------------------------------------------------------------------------ held-out data


def split_held_out(tokens, fraction: float, field: str = "fraction") -> tuple[Any, Any]:
    """``(training part, held-out part)`` of an open ``hybrid.data.TokenFile``: the held-out part is its last
    ``ceil(fraction x windows)`` windows of ``seq_len + 1`` tokens (at least 2: its stream, like every token
    file's, shifts its cut by up to ``seq_len`` tokens), the training part everything before them, which is all
    its stream ever reads. ``field`` names the fraction in the error when too little is left for either."""
    from hybrid.data import TokenFile

    start, stop = tokens.span
    window = tokens.window
    held = max(2, math.ceil(fraction * (tokens.tokens // window)))
    cut = stop - held * window
    if cut - start < 2 * window - 1:
        raise ConfigError(f"{field} is {fraction:g}, which holds out {held} of the {tokens.tokens // window} rows "
                          f"of seq_len {tokens.seq_len} in {tokens.shown} and leaves too few tokens to train on; "
                          f"lower {field} or use more text.")

    def part(span):
        return TokenFile(tokens.path, tokens.seq_len, tokens.seed, check=False, shown_as=tokens.shown, span=span)

    return part((start, cut)), part((cut, stop))


class UnseenSteps:
    """A synthetic stream's held-out batches: batch ``i`` is the stream's batch at step ``-1 - i``, a step
    training (steps 0, 1, ...) never draws; the same chain, so the same distribution."""

    def __init__(self, stream):
        self.stream = stream

    def batch(self, i: int, rows: int, dp_rank: int = 0, dp: int = 1):
        return self.stream.batch(-1 - i, rows, dp_rank, dp)


def stream_eval_batches(ctx: Context, stream, rows: int, count: int) -> Callable[[int], tuple]:
    """``Evaluation.batches`` from a held-out stream serving ``batch(i, rows, dp_rank, dp)`` (a token file or
    ``UnseenSteps``): this DP rank's ``rows`` of held-out batch ``i``, on ``ctx.device``. A token file must hold
    the ``count`` batches' rows in distinct windows (a ``ConfigError`` naming ``eval.batches`` otherwise)."""
    mesh = ctx.mesh
    need, held = count * rows * mesh.dp, getattr(stream, "windows_per_epoch", None)
    if held is not None and need > held:
        raise ConfigError(f"eval.batches is {count}: {count} batches of {rows} rows x {mesh.dp} DP ranks need {need} "
                          f"held-out rows of seq_len {stream.seq_len}, but the held-out data ({stream.shown}) holds "
                          f"{held}; lower eval.batches or hold out more (eval.fraction, or a larger eval.data).")

    def batches(i: int):
        inputs, targets = stream.batch(i, rows, mesh.dp_rank, mesh.dp)
        return inputs.to(ctx.device), targets.to(ctx.device)

    return batches
