"""A Hugging Face causal LM without code: a model config that names a ``transformers`` architecture.

The built-in entrypoint (``hybrid.models.gpt:train``, or ``hybrid.models.hf:train`` itself) trains, instead of
the built-in GPT's ``model:`` shape, the model of an ``hf:`` section::

    hf:
      config: tiny-llama/config.json     # a transformers config.json (or the directory holding one)
      weights: tiny-llama   # optional: start from these weights (a save_pretrained directory, or one .safetensors / .pt)
      seq_len: 128                       # tokens per row
    data: corpus.bin                     # optional: a token file (else the synthetic chain over the vocabulary)
    train: {lr: 0.001}                   # as the built-in GPT's (optimizer, scheduler, clipping, ...)
    zero: {reduce_bucket_size: 50000000} # optional, as the built-in GPT's
    eval: {fraction: 0.05, every: 20}    # optional: held-out loss, as the built-in GPT's

Relative paths are relative to the model config file. The model is
``transformers.AutoModelForCausalLM.from_config(config)``, built under ``hybrid.empty_init()`` (its parameters
on meta, its rotary table computed), split over the rank's TP group by its own TP plan (``hybrid.tp.hf``; or
the cluster file's ``parallel.tp_plan``: ``Context.parallelize``; at TP > 1 its logits left split by vocabulary
and its loss vocabulary-parallel where its forward allows it: ``hybrid.tp.hf_logits``), and given its values by
``hybrid.initialize``: streamed from ``weights`` (each rank reads its slice of its shard), else drawn with the
model's own init (``init_fn=model._init_weights``) from ``job.seed``, the same values at every layout. It is
trained by ``hybrid.runtime.train.run_steps`` on ``(input_ids, labels)`` windows of ``seq_len + 1`` tokens (the
model shifts the labels itself), checkpointing and resuming as the built-in GPT does; the plan's activation
checkpointing is the model's own (``gradient_checkpointing_enable``).

``build_model(model_config, tp_comm=None)`` is the launcher's hook: the unsplit model of a model config whose
``hf:`` paths are absolute (``launch.planning.model_size`` makes them so, ``absolute_paths``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping, Optional

from hybrid.weights.files import INDEX, SINGLE
from hybrid.config import validate as v
from hybrid.errors import ConfigError
from hybrid.models.sections import (data_path, eval_options, held_out_stream, planned_zero, train_options,
                                    training_config, zero_options)
from hybrid.runtime.train import Context, run_steps, stream_batches

HF_KEYS = ("config", "weights", "seq_len")
EXAMPLE = "{config: path/to/config.json, seq_len: 128}"


def _transformers():
    try:
        import transformers
    except ImportError:
        raise ConfigError("the model config's hf: section needs the transformers package; install it "
                          "(pip install transformers) or describe the built-in GPT under model:.") from None
    return transformers


def _path(value: Any, field: str, base: Optional[Path]) -> Path:
    v.text(field, value, "the path of a file")
    path = Path(value).expanduser()
    if not path.is_absolute() and base is not None:
        path = (base / path).resolve()
    return path


def hf_options(section: Any, model_config_path: Optional[str] = None) -> dict:
    """The ``hf:`` section checked: ``config`` (a config.json, or a directory holding one) and ``weights`` as
    paths (relative ones against the model config file's directory), ``seq_len`` a positive whole number."""
    section = v.mapping("hf", section, HF_KEYS, example=EXAMPLE)
    base = Path(model_config_path).resolve().parent if model_config_path else None
    config = _path(v.required(section, "hf", "config", "the path of a transformers config.json"), "hf.config", base)
    if config.is_dir():
        config = config / "config.json"
    if not config.is_file():
        raise ConfigError(f"hf.config is {v.quote(str(config))}, which is not a file; give the path of a "
                          "transformers config.json (or of the directory holding it).")
    weights = section.get("weights")
    if weights is not None:
        weights = _path(weights, "hf.weights", base)
        if not weights.is_file() and not any((weights / name).is_file() for name in (INDEX, SINGLE)):
            raise ConfigError(f"hf.weights is {v.quote(str(weights))}, which is neither a file nor a save_pretrained "
                              f"directory (with {INDEX} or {SINGLE}); give a consolidated .safetensors or .pt file "
                              "or such a directory, or leave hf.weights out to start from random weights.")
    seq_len = v.positive_int("hf.seq_len", v.required(section, "hf", "seq_len", "tokens per row, e.g. 128"))
    return {"config": config, "weights": weights, "seq_len": seq_len}


def absolute_paths(model_config: Mapping, model_config_path) -> dict:
    """``model_config`` with its ``hf:`` paths made absolute against ``model_config_path`` (checked)."""
    options = hf_options(model_config.get("hf"), model_config_path)
    hf = {**model_config["hf"], "config": str(options["config"])}
    if options["weights"] is not None:
        hf["weights"] = str(options["weights"])
    return {**model_config, "hf": hf}


def load_config(path: Path):
    """The transformers config of ``path``; one sentence when transformers cannot read it."""
    transformers = _transformers()
    try:
        return transformers.AutoConfig.from_pretrained(str(path))
    except Exception as err:  # transformers' own reasons: an unknown model_type, bad JSON
        text = " ".join(str(err).split())[:300]
        raise ConfigError(f"hf.config {v.quote(str(path))} is not a config transformers can read "
                          f"({type(err).__name__}: {text}); give the config.json of a causal LM.") from None


def check_seq_len(config: Any, seq_len: int) -> None:
    """A window of ``seq_len + 1`` tokens (``causal_lm_batch``) must fit the model's positions."""
    limit = getattr(config, "max_position_embeddings", None)
    if isinstance(limit, int) and seq_len + 1 > limit:
        raise ConfigError(f"hf.seq_len is {seq_len}, but a row of seq_len + 1 tokens does not fit the model's "
                          f"max_position_embeddings ({limit}); use at most {limit - 1}.")


def new_model(config: Any):
    """``AutoModelForCausalLM.from_config(config)`` on the current device (the caller's ``empty_init`` or meta)."""
    transformers = _transformers()
    try:
        return transformers.AutoModelForCausalLM.from_config(config)
    except ValueError as err:  # no causal LM for this model_type
        kind = getattr(config, "model_type", "?")
        raise ConfigError(f"transformers has no causal LM for the model_type {kind!r} of hf.config "
                          f"({' '.join(str(err).split())[:200]}); give the config of a causal LM.") from None


def build_model(model_config: Mapping, tp_comm=None):
    """The launcher's hook: the unsplit model of ``model_config``'s ``hf:`` section (absolute paths), on the
    current default device; the ranks split it (``Context.parallelize``)."""
    options = hf_options(model_config.get("hf"))
    config = load_config(options["config"])
    check_seq_len(config, options["seq_len"])
    return new_model(config)


def check_model_config(doc: Mapping, path: Path) -> None:
    """What the launcher checks before any rank starts: the ``hf:`` section, the ``train:``, ``zero:`` and
    ``eval:`` options, and the vocabulary of a ``data:`` (or ``eval.data``) token file against the model's."""
    from hybrid.data import TokenFile

    options = hf_options(doc.get("hf"), path)
    train_options(doc.get("train"))
    zero_options(doc.get("zero"))
    evals = eval_options(doc.get("eval"), doc.get("data"))
    config = load_config(options["config"])
    check_seq_len(config, options["seq_len"])
    held = data_path(evals.data, path, field="eval.data") if evals is not None else None
    for data in (data_path(doc.get("data"), path), held):
        if data is not None and data.exists():
            _check_vocab(TokenFile(data, options["seq_len"], check=False), config, data)


def _check_vocab(tokens, config, path) -> None:
    vocab = getattr(config, "vocab_size", None)
    if isinstance(vocab, int) and vocab < tokens.vocab_size:
        raise ConfigError(f"the vocab_size of hf.config is {vocab}, below the vocabulary of the data file {path} "
                          f"({tokens.vocab_size}); train on a token file made with the model's tokenizer.")


def train(ctx: Context, after_step=()) -> dict:
    """Train the model of the ``hf:`` section for ``ctx.steps`` steps, evaluating as its ``eval:`` section says;
    returns this rank's summary."""
    import hybrid
    from hybrid.data import MarkovTokens, TokenFile
    from hybrid.runtime.evaluate import Evaluation, stream_eval_batches

    options = hf_options(ctx.model_config.get("hf"), ctx.model_config_origin)
    train_opts = train_options(ctx.model_config.get("train"))
    evals = eval_options(ctx.model_config.get("eval"), ctx.model_config.get("data"))
    config = load_config(ctx.local_path(options["config"]))
    # checkpoints record the architecture itself, so `consolidate --hf` writes its config.json with no path to find
    ctx.model_config = {**ctx.model_config, "hf": {**ctx.model_config["hf"], "config": json.loads(config.to_json_string())}}
    seq_len = options["seq_len"]
    check_seq_len(config, seq_len)
    with hybrid.empty_init():
        model = new_model(config)
    model = ctx.parallelize(model)
    if ctx.settings.activation_checkpointing:
        (getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable)()
    engine_config = training_config(train_opts, ctx.stage, ctx.settings.precision, ctx.settings.offload,
                                    zero=planned_zero(ctx),
                                    accumulation=ctx.settings.gradient_accumulation_steps,
                                    nvme_path=ctx.settings.nvme_path)
    values = (dict(weights=str(ctx.local_path(options["weights"]))) if options["weights"] is not None else
              dict(seed=ctx.settings.seed, init_fn=model._init_weights))
    engine = hybrid.initialize(model, engine_config, dp_group=ctx.mesh.dp_group, tp_group=ctx.mesh.tp_group,
                               device=ctx.device, **values)
    data = data_path(ctx.model_config.get("data"), ctx.model_config_origin)
    if data is None:
        stream = MarkovTokens(config.vocab_size, seq_len, seed=ctx.settings.seed, branching=train_opts["branching"])
        reference = {"name": "synthetic chain floor", "nats": stream.loss_floor}
    else:
        stream = TokenFile(ctx.local_path(data), seq_len, seed=ctx.settings.seed, shown_as=data)
        _check_vocab(stream, config, data)
        reference = {"name": "unigram entropy of the data", "nats": stream.unigram_entropy}

    def open_held_out(path):
        held = TokenFile(ctx.local_path(path), seq_len, seed=ctx.settings.seed, shown_as=path)
        _check_vocab(held, config, path)
        return held

    stream, held_out = held_out_stream(evals, stream, ctx.model_config_origin, open_held_out)
    evaluation = None
    if held_out is not None:
        held_windows = stream_eval_batches(ctx, held_out, ctx.settings.micro_batch, evals.batches)
        evaluation = Evaluation(lambda i: causal_lm_batch(*held_windows(i)), evals.batches, evals.every)
    rows = ctx.settings.micro_batch * ctx.settings.gradient_accumulation_steps
    windows = stream_batches(ctx, stream, rows)
    summary = run_steps(ctx, engine, lambda step: causal_lm_batch(*windows(step)),
                        tokens_per_step=rows * ctx.mesh.dp * seq_len, after_step=after_step, evaluate=evaluation)
    return {**summary, "reference_loss": reference, "stage": ctx.stage, "tp": ctx.mesh.tp,
            "memory": engine.memory_report()}


def causal_lm_batch(inputs, targets) -> dict:
    """A Hugging Face causal LM's keyword arguments for a window: the unshifted ``seq_len + 1`` tokens as
    both ``input_ids`` and ``labels`` (the model shifts the labels; ``labels=targets`` would shift twice)."""
    import torch

    ids = torch.cat([inputs, targets[:, -1:]], dim=1)
    return {"input_ids": ids, "labels": ids}
