"""The built-in entrypoint ``hybrid.models.gpt:train``: train the built-in GPT on a synthetic stream.

``train(ctx)`` builds the GPT of the model config (TP-sliced over ``ctx.mesh.tp_comm``), wraps it in the
ZeRO engine at the planned stage on the mesh's DP group, and trains it on ``hybrid.data.MarkovTokens``:
each DP rank takes its own slice of the step's global batch, the TP ranks of a group take the same one.
Every step reports loss, tokens/s and the engine's memory report through ``ctx.report``. With a checkpoint
directory in the job, every rank resumes from its latest checkpoint and saves on the job's cadence
(``hybrid.train.run_steps``); the stream yields the same batch for the same step, so the data position
is the step.

The model config may carry an optional ``train:`` mapping beside ``model:`` with ``lr``,
``weight_decay``, ``gradient_clipping`` and ``branching`` (successors per token in the synthetic chain).
"""

from __future__ import annotations

from typing import Any, Mapping

from hybrid.data import MarkovTokens
from hybrid import validate as v
from hybrid.models.gpt import GPT
from hybrid.models.gpt_config import GPTConfig
from hybrid.train import Context, run_steps

TRAIN_DEFAULTS = {"lr": 5e-3, "weight_decay": 0.0, "gradient_clipping": 1.0, "branching": 4}


def train(ctx: Context) -> dict:
    """Train the configured GPT for ``ctx.steps`` steps; returns this rank's summary."""
    model_config = GPTConfig.from_dict(ctx.model_config.get("model", {}))
    options = train_options(ctx.model_config.get("train"))
    engine = build_engine(ctx, model_config, options)
    stream = MarkovTokens(model_config.vocab_size, model_config.seq_len, seed=ctx.settings.seed,
                          branching=options["branching"])
    micro_batch, mesh = ctx.settings.micro_batch, ctx.mesh

    def batches(step: int):
        inputs, targets = stream.batch(step, micro_batch, mesh.dp_rank, mesh.dp)
        return inputs.to(ctx.device), targets.to(ctx.device)

    tokens_per_step = micro_batch * mesh.dp * model_config.seq_len
    summary = run_steps(ctx, engine, batches, tokens_per_step=tokens_per_step)
    return {**summary, "loss_floor": stream.loss_floor, "stage": ctx.stage, "memory": engine.memory_report()}


def train_options(section: Any) -> dict:
    """The ``train:`` mapping of the model config over ``TRAIN_DEFAULTS``, each value checked; unknown keys
    are errors."""
    if section is None:
        return dict(TRAIN_DEFAULTS)
    options = {**TRAIN_DEFAULTS, **v.mapping("train", section, TRAIN_DEFAULTS, example="{lr: 0.005}")}
    options["lr"] = v.positive_number("train.lr", v.yaml_number(options["lr"]))
    options["weight_decay"] = v.number("train.weight_decay", v.yaml_number(options["weight_decay"]), lo=0)
    clip = options["gradient_clipping"]
    options["gradient_clipping"] = None if clip is None else v.number("train.gradient_clipping",
                                                                       v.yaml_number(clip), lo=0)
    options["branching"] = v.positive_int("train.branching", options["branching"])
    return options


def build_engine(ctx: Context, model_config: GPTConfig, options: dict):
    """The TP-sliced GPT wrapped in the ZeRO engine at the planned stage, on the mesh's DP group."""
    # Imported here so that importing hybrid.models.gpt (which re-exports train) stays light.
    import hybrid
    from hybrid.config import OptimizerConfig, TrainConfig, ZeroConfig

    model = GPT(model_config, tp_comm=ctx.mesh.tp_comm, seed=ctx.settings.seed, device=ctx.device)
    config = TrainConfig(zero=ZeroConfig(stage=ctx.stage), precision=ctx.settings.precision,
                         optimizer=OptimizerConfig(lr=float(options["lr"]), weight_decay=float(options["weight_decay"])),
                         gradient_clipping=options["gradient_clipping"])
    return hybrid.initialize(model, config, dp_group=ctx.mesh.dp_group, tp_group=ctx.mesh.tp_group)
