"""The built-in entrypoint ``hybrid.models.gpt:train``: train the built-in GPT on a token file or a synthetic stream.

``train(ctx)`` builds the GPT of the model config (TP-sliced over ``ctx.mesh.tp_comm``) on the meta device,
so the engine materializes it straight into each rank's shard (``hybrid.materialize``), wraps it in the
ZeRO engine at the planned stage on the mesh's DP group, and trains it on the token file the model config
names under ``data:`` (a ``hybrid.data.TokenFile``; a relative path is relative to the model config file;
``model.vocab_size`` must be at least the file's vocabulary), else on ``hybrid.data.MarkovTokens``:
each DP rank takes its own slice of the step's global batch, the TP ranks of a group take the same one.
Every step reports loss, tokens/s and the engine's memory report through ``ctx.report``. A step is
``micro_batch × gradient_accumulation_steps`` rows per rank, trained as micro-batches of ``micro_batch``. With a checkpoint
directory in the job, every rank resumes from its latest checkpoint and saves on the job's cadence
(``hybrid.runtime.train.run_steps``); the stream yields the same batch for the same step, so the data position
is the step.

With an ``eval:`` mapping in the model config (``hybrid.models.sections.EvalOptions``: ``fraction`` or ``data``,
``every``, ``batches``) the loop evaluates the held-out loss every ``every`` steps and at the last
(``hybrid.runtime.evaluate``): on the last ``fraction`` of the token file's windows, which training then never
reads, on a second token file (``data``, checked against the model as ``data:`` is), or, on the synthetic chain,
on its sequences training never draws; ``batches`` batches of ``micro_batch`` rows per rank each time.

The summary names the loss to beat: ``reference_loss`` with the unigram entropy of the token file (a model
below it learned more than token frequencies) or the synthetic chain's floor.

The model config may carry an optional ``train:`` mapping beside ``model:`` with ``lr``,
``weight_decay``, ``gradient_clipping``, ``branching`` (successors per token in the synthetic chain),
``optimizer`` (the ``optimizer`` section of ``hybrid.config.TrainConfig.from_dict``: ``{type: SGD,
params: {momentum: 0.9}}``, ``no_decay``, ``param_groups``; ``lr`` and ``weight_decay`` above are its
defaults) and ``scheduler`` (``{type: WarmupCosineLR, params: {...}}``). With ``offload`` in the job's
settings the optimizer state is kept in host memory (``zero.offload_optimizer``).

``build_model(model_config, tp_comm=None)`` is the launcher's hook (``launch.planning.model_size``): the GPT of the
model config, which the driver builds under ``torch.device("meta")`` to count Ψ and see its TP layers.
``build_engine`` honours the plan's levers in ``ctx.settings``: ``activation_checkpointing`` through the
GPT config's field of that name, ``offload`` through the DeepSpeed-style
``zero_optimization.offload_optimizer: {device: cpu}``.

A model config with an ``hf:`` section instead of ``model:`` names a transformers causal LM
(``hybrid.models.hf``): ``train``, ``build_model`` and ``check_model_config`` hand it to that module.

The model config may also carry an optional ``zero:`` mapping of ``hybrid.config.ZeroConfig`` sizes
(``reduce_bucket_size``, ``prefetch_bucket_size``, ``param_persistence_threshold``, ...; not ``stage``, which
is the plan's); the launcher's memory prediction reads the same mapping (``zero_options``).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Mapping, Optional

from hybrid.config import validate as v
from hybrid.data import MarkovTokens, TokenFile
from hybrid.errors import ConfigError, DataError
from hybrid.models.gpt.model import GPT
from hybrid.models.gpt.config import GPTConfig
# data_path, train_options, training_config, zero_options, with_plan_links: the shared sections, named here too
# (an own loop's imports, README) as the built-in loop's pieces
from hybrid.models.sections import (data_path, eval_options, held_out_stream, planned_zero,  # noqa: F401
                                    train_options, training_config, with_plan_links, zero_options)
from hybrid.runtime.evaluate import Evaluation, stream_eval_batches
from hybrid.runtime.train import Context, run_steps, stream_batches

# The model config's top-level keys for this entrypoint (``params:`` is the launcher's Ψ override).
CONFIG_KEYS = ("model", "hf", "data", "train", "zero", "eval", "params")


def train(ctx: Context, after_step=()) -> dict:
    """Train the configured GPT (or the ``hf:`` model: ``hybrid.models.hf.train``) for ``ctx.steps`` steps;
    returns this rank's summary. ``after_step``: hooks ``(ctx, engine, step)`` run after every step
    (``hybrid.runtime.train.run_steps``)."""
    check_config_keys(ctx.model_config)
    if is_hf_config(ctx.model_config):
        from hybrid.models import hf

        return hf.train(ctx, after_step)
    model_config = GPTConfig.from_dict(ctx.model_config.get("model", {}))
    options = train_options(ctx.model_config.get("train"))
    evals = eval_options(ctx.model_config.get("eval"), ctx.model_config.get("data"))
    engine = build_engine(ctx, model_config, options)
    stream, reference = data_source(ctx, model_config, options)
    stream, held_out = held_out_stream(evals, stream, ctx.model_config_origin, lambda path: open_token_file(
        path, ctx.local_path(path), model_config, seed=ctx.settings.seed, field="eval.data"))
    evaluation = None if held_out is None else Evaluation(
        stream_eval_batches(ctx, held_out, ctx.settings.micro_batch, evals.batches), evals.batches, evals.every)
    # A step takes micro_batch x gradient_accumulation_steps rows per rank, as micro-batches of micro_batch:
    # a re-plan that halves the micro-batch and doubles the accumulation keeps the step's rows.
    rows = ctx.settings.micro_batch * ctx.settings.gradient_accumulation_steps
    tokens_per_step = rows * ctx.mesh.dp * model_config.seq_len
    summary = run_steps(ctx, engine, stream_batches(ctx, stream, rows), tokens_per_step=tokens_per_step,
                        after_step=after_step, evaluate=evaluation)
    return {**summary, "reference_loss": reference, "stage": ctx.stage, "memory": engine.memory_report()}


def data_source(ctx: Context, model_config: GPTConfig, options: dict) -> tuple[Any, dict]:
    """The batches to train on and the loss to compare with: the model config's ``data:`` token file (and
    its unigram entropy), else the synthetic chain (and its floor)."""
    seed = ctx.settings.seed
    path = data_path(ctx.model_config.get("data"), ctx.model_config_origin)
    if path is None:
        stream = MarkovTokens(model_config.vocab_size, model_config.seq_len, seed=seed, branching=options["branching"])
        return stream, {"name": "synthetic chain floor", "nats": stream.loss_floor}
    tokens = open_token_file(path, ctx.local_path(path), model_config, seed=seed)
    return tokens, {"name": "unigram entropy of the data", "nats": tokens.unigram_entropy}


def open_token_file(path: Path, local: Path, model_config: GPTConfig, seed: int = 0, check: bool = True,
                    field: str = "data") -> TokenFile:
    """The token file the model config names (``path``, as the user wrote it resolved on the driver; ``field``:
    under which key) where this process sees it (``local``: the copy shipped with ``job.working_dir``, or
    ``path`` itself), checked against the model; every error names ``path``, never the rank's copy."""
    if not local.exists() and local != path:
        raise DataError(f"data file {path} ({field}: in the model config) was not shipped with job.working_dir "
                        "(a .gitignore pattern in job.working_dir leaves it out) and this node does not "
                        "see it at that path; keep data on storage every node mounts, or un-exclude it.")
    tokens = TokenFile(local, model_config.seq_len, seed=seed, check=check, shown_as=path)
    if model_config.vocab_size < tokens.vocab_size:
        raise ConfigError(f"model.vocab_size is {model_config.vocab_size}, below the vocabulary of the data file "
                          f"{path} ({tokens.vocab_size}); set model.vocab_size to at least {tokens.vocab_size}.")
    return tokens


def check_config_keys(doc: Any, path: Optional[Path] = None) -> None:
    """The built-in entrypoint's model config holds only ``CONFIG_KEYS`` (a misspelt ``data:`` would
    otherwise train on the synthetic stream without a word), and not both ``model:`` and ``hf:``."""
    if isinstance(doc, Mapping):
        try:
            v.known_keys("", doc, CONFIG_KEYS)
        except ConfigError as err:
            raise ConfigError(f"the model config{f' {path}' if path else ''}: {err}") from None
        if "model" in doc and "hf" in doc:
            raise ConfigError(f"the model config{f' {path}' if path else ''} has both model: (the built-in GPT's "
                              "shape) and hf: (a transformers model); keep the one to train.")


def check_model_config(doc: Any, path: Path) -> None:
    """What the launcher checks on the driver before any rank starts: the keys, the ``train:`` and ``eval:``
    options and, when ``data:`` (or ``eval.data``) names a file that exists, that it opens as a token file the
    model can train on (its metadata and size; the ranks scan its ids). A file not there yet (``make demo``
    prepares its corpus after a plan may be shown) is the ranks' to refuse."""
    check_config_keys(doc, path)
    if is_hf_config(doc):
        from hybrid.models import hf

        return hf.check_model_config(doc, path)
    train_options(doc.get("train") if isinstance(doc, Mapping) else None)
    if not isinstance(doc, Mapping):
        return
    evals = eval_options(doc.get("eval"), doc.get("data"))
    if not isinstance(doc.get("model"), Mapping):
        return
    model_config = GPTConfig.from_dict(doc["model"])
    held = data_path(evals.data, path, field="eval.data") if evals is not None else None
    for field, data in (("data", data_path(doc.get("data"), path)), ("eval.data", held)):
        if data is not None and data.exists():
            open_token_file(data, data, model_config, check=False, field=field)


def build_model(model_config: Mapping, tp_comm=None):
    """The launcher's hook: the GPT of a parsed model config (its ``model:`` mapping), TP-sliced over
    ``tp_comm``, on the current default device (the driver calls it under ``torch.device("meta")``); for an
    ``hf:`` section, the unsplit transformers model (``hybrid.models.hf.build_model``)."""
    if is_hf_config(model_config):
        from hybrid.models import hf

        return hf.build_model(model_config, tp_comm)
    if not isinstance(model_config, Mapping) or "model" not in model_config:
        raise ConfigError("the model config has no model: mapping for the built-in GPT; put vocab_size, seq_len, "
                          "n_layers, hidden and n_heads under model:, or name a transformers model under hf: "
                          "({config: path/to/config.json, seq_len: 128}), or, for a model of your own, define "
                          "build_model(model_config, tp_comm=None) in the entrypoint's module.")
    return GPT(GPTConfig.from_dict(model_config["model"]), tp_comm=tp_comm)


def is_hf_config(model_config: Any) -> bool:
    """Whether the model config names a transformers model (``hf:``) rather than the GPT's ``model:`` shape."""
    return isinstance(model_config, Mapping) and "hf" in model_config


def with_levers(model_config: GPTConfig, activation_checkpointing: bool) -> GPTConfig:
    """The GPT config with the plan's activation checkpointing."""
    if not activation_checkpointing:
        return model_config
    if not hasattr(model_config, "activation_checkpointing"):
        raise ConfigError("the plan turns activation checkpointing on, but this build of the built-in GPT has no "
                          "activation_checkpointing field; set parallel.activation_checkpointing: false.")
    return dataclasses.replace(model_config, activation_checkpointing=True)


def build_engine(ctx: Context, model_config: GPTConfig, options: dict):
    """The TP-sliced GPT wrapped in the ZeRO engine at the planned stage and levers, on the mesh's DP group."""
    # Imported here so that importing hybrid.models.gpt (which re-exports train) stays light.
    import hybrid

    model_config = with_levers(model_config, getattr(ctx.settings, "activation_checkpointing", False))
    # Built on meta: the engine draws each parameter's values where this rank keeps them (no full copy).
    model = GPT(model_config, tp_comm=ctx.mesh.tp_comm, device="meta")
    config = training_config(options, ctx.stage, ctx.settings.precision, getattr(ctx.settings, "offload", False),
                             zero=planned_zero(ctx), accumulation=ctx.settings.gradient_accumulation_steps,
                             nvme_path=getattr(ctx.settings, "nvme_path", None))
    return hybrid.initialize(model, config, dp_group=ctx.mesh.dp_group, tp_group=ctx.mesh.tp_group,
                             seed=ctx.settings.seed, device=ctx.device)
