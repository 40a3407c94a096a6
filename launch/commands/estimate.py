"""``hybrid estimate``: the seed's per-GPU memory table for ZeRO stages 0-3 and the recommended stage.

Human output is the seed's table (one row per component, one column per stage) followed by the planner's
choice. ``--json`` prints exactly one JSON object:
``{"params", "dp", "tp", "gpu_memory_gb", "stages": {"0".."3": {"params_gb", "grads_gb", "optimizer_gb",
"total_gb", "fits"}}, "recommended_stage", "offload", "activation_checkpointing", "reason"}``, plus
``"activations_gb"`` and ``"activations_estimate"`` when the model shape is given (each ``total_gb`` then
includes the activations, the checkpointed estimate under ``--activation-checkpointing``; without the flag the
planner may still choose checkpointing when plain ZeRO-3 does not fit), and ``"prediction"`` (stage ->
``hybrid.plan.memory.MemoryPrediction.as_dict()``, bytes) when ``--vocab`` is given too: the complete prediction of
the built-in GPT of that shape, which the human output shows as a second table. GB means 10^9 bytes, as in
the seed; sizes print through ``hybrid.config.units.human_bytes``.

Which activation estimate (``ESTIMATES``): with ``--vocab`` the built-in GPT's whole shape is known, and the
table, the recommendation and the prediction all use that GPT's profile (``launch.planning.model_size.gpt_figures``)
-- the figures ``hybrid plan`` gives ``choose_stage`` for that model, so the two pick the same stage at the same
totals.
Without it, the generic transformer formula ``hybrid.plan.memory.activation_bytes`` (Korthikanti et al. 2022).
A shape the GPT cannot have is refused in the CLI's terms either way: ``--heads`` must divide ``--hidden``,
and ``--tp`` what ``GPTConfig.check_tp`` splits (the heads, the MLP width and, with ``--vocab``, the vocabulary).
``--gpus-per-node`` is the node size: the ranks that share a node's host memory under offload, and the unit of
the GPU count a no-fit error suggests (whole nodes); without it only the TP group is known to share a node
(``choose_stage``'s ``ranks_per_node`` is then ``--tp`` and the suggestion is said in GPUs).
``--host-memory`` (a node's host memory: ``1TB``, ``512GB``, or a number of GB) checks the offloaded states
against it; where CPU offload does not fit it, the plan takes the guide's next row, the optimizer states
offloaded to NVMe (``hybrid.plan.planner``), and says the swap files' bytes per node and what a step reads and
writes; ``--nvme`` (the same units) checks those against a node's disk. With offload the JSON also carries
``"offload_device"`` (``none`` | ``cpu`` | ``nvme``), ``"host_bytes_per_node"`` and, with NVMe, ``"nvme"``:
``{"disk_bytes_per_rank", "disk_bytes_per_node", "read_bytes_per_step", "write_bytes_per_step"}`` (per rank).
``--time`` (with the whole shape) ranks every layout that fits by predicted tokens/s for a cluster not yet
booked (``launch.commands.estimate_time``): the GPU (``--gpu``, ``--gpu-tflops``), the links (``--intra``,
``--inter``, ``--intra-gbps``, ``--inter-gbps``, ``--nics-per-node``) from ``hybrid.plan.hardware``'s tables,
TP degrees dividing the node, stages, levers and micro-batches keeping ``--global-batch``; it prints the
table ``hybrid plan`` prints, the chosen layout and its predicted throughput per GPU, and ``--json`` adds
``time``.
``--hf CONFIG.json`` (a transformers config, or its directory; with ``--seq`` and ``--micro-batch``, without the
shape options): the model on paper, no weights (``launch.commands.estimate_time.hf_model``): Ψ is counted (a
``--params`` beside it must agree to 1 %), ``--tp`` must split what the config says, and the activation row
(``"activations_estimate": "profile"``) and ``--time``'s FLOPs, recompute and ops are the model's measured
profile's, the figures ``hybrid plan`` uses for an ``hf:`` model; the JSON adds ``"profile"`` (the model's class,
layers, width, FLOPs per token and activations of one micro-batch with and without checkpointing).
Any bad input ends with one ``error: ...`` line and exit status 2.
"""

from __future__ import annotations

import json
import re
from fractions import Fraction

import click

from hybrid.config import validate as v
from hybrid.errors import ConfigError
from hybrid.plan.memory import parse_count
from hybrid.models.gpt.config import GPTConfig, shape_violation
from hybrid.plan.planner import MAX_GPUS, Plan, check_headroom, choose_stage, quantity
from hybrid.config.units import human_bytes
from hybrid.config.validate import DEFAULT_PRECISION, PRECISIONS, STAGES
from launch.commands.estimate_time import activation_estimate
from launch.spec import MAX_GPU_MEMORY_GB, MAX_GPUS_PER_NODE, MAX_HOST_MEMORY_GB, MAX_NVME_GB

_SHAPE = ("layers", "hidden", "heads", "seq", "micro_batch")
# activations_estimate in the JSON -> the label of the table's activation row
ESTIMATES = {"gpt": "Activations (GPT)", "korthikanti": "Activations (Korthikanti)",
             "profile": "Activations (profile)"}


_SIZE_UNITS = {"": 10**9, "GB": 10**9, "TB": 10**12, "G": 10**9, "T": 10**12}


def size_option(option: str, text, limit_gb: float) -> int | None:
    """Bytes from ``1TB``, ``512GB``, ``1.5T`` or a plain number of GB (``--host-memory``, ``--nvme``)."""
    if text is None:
        return None
    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([A-Za-z]*)\s*", str(text))
    unit = match.group(2).upper() if match else None
    if unit not in _SIZE_UNITS or float(match.group(1)) <= 0:
        raise v.invalid(option, "a size per node such as 1TB, 512GB or 768 (GB)", text)
    size = Fraction(match.group(1)) * _SIZE_UNITS[unit]
    if size > limit_gb * 10**9:
        raise v.invalid(option, f"a size per node of at most {limit_gb:,.0f} GB", text)
    return int(size)


def _gb(value) -> float:
    return float(Fraction(value) / 10**9)


def _plain(number: float) -> int | float:
    return int(number) if float(number).is_integer() else number


def _validate(gpus: int, tp: int, gpus_per_node: int | None, gpu_memory: float, headroom: float, shape: dict,
              vocab: int | None) -> None:
    """Every option, before anything is computed; a bad one is one ``ConfigError`` sentence naming it."""
    v.integer("--gpus", gpus, 1, MAX_GPUS,
              need=f"a whole number from 1 to {MAX_GPUS:,} (the total GPU count, DP × TP)")
    v.integer("--tp", tp, 1, MAX_GPUS, need=f"a whole number from 1 to {MAX_GPUS:,}")
    if gpus % tp:
        raise ConfigError(f"--gpus ({gpus:,}) must be a multiple of --tp ({tp:,}), since DP degree = gpus / tp.")
    if gpus_per_node is not None:
        v.integer("--gpus-per-node", gpus_per_node, 1, MAX_GPUS_PER_NODE,
                  need=f"a whole number from 1 to {MAX_GPUS_PER_NODE:,} (the GPUs of one node)")
        if gpus_per_node % tp:
            raise ConfigError(f"--gpus-per-node ({gpus_per_node:,}) must be a multiple of --tp ({tp:,}), since a "
                              "TP group lies inside one node.")
        if gpus % gpus_per_node:
            raise ConfigError(f"--gpus ({gpus:,}) must be a multiple of --gpus-per-node ({gpus_per_node:,}), since "
                              "a cluster has whole nodes.")
    v.positive_number("--gpu-memory", gpu_memory, MAX_GPU_MEMORY_GB, unit="GB per GPU")
    check_headroom("--headroom", headroom)
    given = [name for name in _SHAPE if shape[name] is not None]
    if given and len(given) != len(_SHAPE):
        missing = ", ".join("--" + name.replace("_", "-") for name in _SHAPE if shape[name] is None)
        raise ConfigError(f"the activation estimate needs the whole model shape: also give {missing}.")
    for name in given:
        v.positive_int("--" + name.replace("_", "-"), shape[name])
    if vocab is not None:
        if not given:
            raise ConfigError("--vocab adds the built-in GPT's complete prediction, which needs the whole model "
                              "shape: also give --layers, --hidden, --heads, --seq and --micro-batch.")
        v.positive_int("--vocab", vocab)
    if given:
        _check_split(shape, tp, vocab)


def _check_split(shape: dict, tp: int, vocab: int | None) -> None:
    """The shape must be one the built-in GPT can have and split ``tp`` ways (``gpt_config.shape_violation``,
    said in the CLI's options; tp dividing the heads divides the MLP width mlp_ratio·hidden too)."""
    heads, hidden = shape["heads"], shape["hidden"]
    broken = shape_violation(hidden, heads, tp, vocab)
    if broken is None:
        return
    field, n, _ = broken
    if field == "hidden":
        raise ConfigError(f"--heads ({heads}) does not divide --hidden ({hidden}); choose --heads so that "
                          f"--hidden is a multiple of it.")
    option = {"n_heads": "--heads", "vocab_size": "--vocab"}[field]
    raise ConfigError(f"--tp ({tp}) does not divide {option} ({n}); choose a --tp that divides {n} or "
                      f"change {option}.")


def _offload_json(plan: Plan) -> dict:
    """Where the optimizer states go and the bytes per node they take there (``hybrid estimate --json``)."""
    out = {"offload_device": plan.offload_device, "host_bytes_per_node": plan.host_bytes_per_node}
    if plan.nvme:
        out["nvme"] = {"disk_bytes_per_rank": plan.disk_bytes, "disk_bytes_per_node": plan.disk_bytes_per_node,
                       "read_bytes_per_step": plan.disk_bytes, "write_bytes_per_step": plan.disk_bytes}
    return out


def _offload_lines(plan: Plan) -> list[str]:
    """The offload row's bytes, said beside the reason: a node's host and, with NVMe, its disk and traffic."""
    if not plan.offload:
        return []
    n = plan.ranks_per_node
    lines = [f"Host:    {human_bytes(plan.host_bytes)} per rank x {n:,} = {human_bytes(plan.host_bytes_per_node)} "
             f"per node" + (" (gradient shards and swap buffers)" if plan.nvme else
                            " (optimizer states and gradients)")]
    if plan.nvme:
        lines.append(f"NVMe:    {human_bytes(plan.disk_bytes)} per rank x {n:,} = "
                     f"{human_bytes(plan.disk_bytes_per_node)} per node of swap files; each step reads and writes "
                     f"{human_bytes(plan.disk_bytes)} per rank ({human_bytes(plan.disk_bytes_per_node)} per node) "
                     "each way")
    return lines


def _as_json(params: int, gpu_memory: float, plan: Plan, activations: float | None, kind: str | None) -> dict:
    extra = activations or 0.0
    stages = {
        str(stage): {
            "params_gb": _gb(plan.stages[stage].params),
            "grads_gb": _gb(plan.stages[stage].grads),
            "optimizer_gb": _gb(plan.stages[stage].optimizer),
            "total_gb": _gb(Fraction(plan.stages[stage].total) + Fraction(extra)),
            "fits": plan.fits[stage],
        }
        for stage in STAGES
    }
    out = {"params": params, "dp": plan.dp, "tp": plan.tp, "gpu_memory_gb": _plain(gpu_memory)}
    if activations is not None:
        out["activations_gb"] = _gb(activations)
        out["activations_estimate"] = kind
    out.update(
        {"stages": stages, "recommended_stage": plan.stage, "offload": plan.offload,
         "activation_checkpointing": plan.activation_checkpointing, "reason": plan.reason}
    )
    if plan.offload:
        out.update(_offload_json(plan))
    return out


def _as_table(params: int, precision: str, gpu_memory: float, plan: Plan, activations: float | None,
              kind: str | None, gpus_per_node: int | None) -> str:
    p_kind, o_kind = precision.upper(), "FP32"
    rows = [
        ["Component", "Stage 0 (DDP)", "Stage 1", "Stage 2", "Stage 3"],
        [f"Params ({p_kind})"] + [human_bytes(plan.stages[s].params) for s in STAGES],
        [f"Grads ({p_kind})"] + [human_bytes(plan.stages[s].grads) for s in STAGES],
        [f"Optimizer ({o_kind})"] + [human_bytes(plan.stages[s].optimizer) for s in STAGES],
    ]
    extra = activations or 0.0
    if activations is not None:
        rows.append([ESTIMATES[kind]] + [human_bytes(activations)] * len(STAGES))
    rows.append(["Per GPU"] + [human_bytes(Fraction(plan.stages[s].total) + Fraction(extra)) for s in STAGES])
    rows.append([f"Fits on {_plain(gpu_memory)} GB?"] + ["Yes" if plan.fits[s] else "No" for s in STAGES])

    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    nodes = "" if gpus_per_node is None else \
        f" ({quantity(plan.dp * plan.tp // gpus_per_node, 'node')} of {gpus_per_node:,})"
    lines = [
        f"{quantity(params, 'parameter')} ({precision}) on {quantity(plan.dp * plan.tp, 'GPU')}{nodes}: "
        f"DP {plan.dp:,} × TP {plan.tp:,}, {_plain(gpu_memory)} GB each, {human_bytes(plan.usable_bytes)} usable at "
        f"{plan.headroom * 100:g}% headroom",
        "",
    ]
    for i, row in enumerate(rows):
        lines.append("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip())
        if i == 0:
            lines.append("  ".join("-" * width for width in widths))
    offload = "NVMe offload of optimizer states" if plan.nvme else "CPU offload of optimizer states"
    levers = [text for on, text in ((plan.offload, offload),
                                    (plan.activation_checkpointing, "activation checkpointing")) if on]
    with_ = f" with {' and '.join(levers)}" if levers else ""
    lines += ["", f"Recommended: ZeRO stage {plan.stage}{with_}", f"Reason: {plan.reason}"]
    return "\n".join(lines + _offload_lines(plan))


def _hf_options(shape: dict, vocab) -> None:
    """With ``--hf`` the config gives the shape: the shape options are refused, one sentence."""
    given = [f"--{name}" for name in ("layers", "hidden", "heads") if shape[name] is not None]
    if vocab is not None:
        given.append("--vocab")
    if given:
        raise ConfigError(f"--hf gives the model's shape, so leave out {', '.join(given)} (--seq and --micro-batch "
                          "are still yours to give).")


@click.command("estimate")
@click.option("--params", "params_text", help="Parameter count Ψ: 7B, 1.3B, 350M, 13e9, ... (required unless --hf "
              "gives the model; beside it, a check to 1%).")
@click.option("--hf", "hf_config", help="A transformers config.json (or its directory): the model's Ψ, activations "
              "and (with --time) FLOPs from its profile on fake tensors, no weights; with --seq and --micro-batch.")
@click.option("--gpus", type=int, required=True, help="Total GPU count (DP × TP).")
@click.option("--tp", type=int, default=1, show_default=True, help="Tensor-parallel degree; DP = gpus / tp.")
@click.option("--gpus-per-node", type=int, help="GPUs of one node (a multiple of --tp; --gpus a multiple of it): "
              "the ranks sharing a node's host memory with offload, and the unit of a suggested GPU count. "
              "Default: unknown, only the TP group (--tp) is known to share a node.")
@click.option("--gpu-memory", type=float, default=80.0, show_default=True, help="Memory per GPU in GB (10^9).")
@click.option("--host-memory", help="A node's host memory (1TB, 512GB, or GB): checks the offloaded optimizer "
              "states against it; where CPU offload does not fit, the plan offloads them to NVMe. Default: unknown.")
@click.option("--nvme", "nvme_text", help="A node's local NVMe disk space for NVMe offload's swap files (3.84TB, "
              "or GB). Default: unknown, not checked.")
@click.option("--precision", type=click.Choice(PRECISIONS), default=DEFAULT_PRECISION, show_default=True)
@click.option("--headroom", type=float, default=0.1, show_default=True, help="Fraction of memory kept free.")
@click.option("--layers", type=int, help="Transformer layers (with --hidden --heads --seq --micro-batch).")
@click.option("--hidden", type=int, help="Hidden size.")
@click.option("--heads", type=int, help="Attention heads.")
@click.option("--seq", type=int, help="Sequence length.")
@click.option("--micro-batch", type=int, help="Micro-batch size per GPU.")
@click.option("--activation-checkpointing", is_flag=True, help="Estimate activations with full checkpointing.")
@click.option("--vocab", type=int, help="Vocabulary size: with the whole shape, adds the complete prediction of the "
              "built-in GPT of that shape (states as the engine lays them out, buckets, activations, reserve), and the "
              "table uses that GPT's activation estimate, as hybrid plan does.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of the table.")
@click.option("--time", "with_time", is_flag=True, help="Also rank every layout that fits by predicted tokens/s "
              "(TP degree, stage, levers, micro-batch; needs the whole shape, or --hf) and print the fastest.")
@click.option("--gpu", default="H100", show_default=True, help="With --time: the GPU (H100, H200, A100, A100-40GB, "
              "B200, L40S, ... or an NVML name).")
@click.option("--gpu-tflops", type=float, help="With --time: peak TFLOP/s per GPU in --precision (instead of the "
              "GPU table's).")
@click.option("--intra", type=click.Choice(("nvlink", "pcie", "loopback")), default="nvlink", show_default=True,
              help="With --time: the link between the GPUs of a node.")
@click.option("--inter", type=click.Choice(("infiniband", "roce", "ethernet", "loopback")), default="infiniband",
              show_default=True, help="With --time: the link between nodes.")
@click.option("--intra-gbps", type=float, help="With --time: the intra-node link's rate per GPU, Gb/s one way.")
@click.option("--inter-gbps", type=float, help="With --time: one NIC's rate, Gb/s one way (400 for NDR).")
@click.option("--nics-per-node", type=int, help="With --time: NICs per node (default: one per GPU; ethernet 1).")
@click.option("--global-batch", type=int, help="With --time: sequences per optimizer step, kept by every layout "
              "(the micro-batch is then chosen); default --micro-batch x DP at --tp.")
def estimate(params_text, hf_config, gpus, tp, gpus_per_node, gpu_memory, host_memory, nvme_text, precision, headroom,
             layers, hidden, heads, seq, micro_batch, activation_checkpointing, vocab, as_json, with_time, gpu,
             gpu_tflops, intra, inter, intra_gbps, inter_gbps, nics_per_node, global_batch) -> None:
    """Per-GPU memory of each ZeRO stage (the seed's tables) and the recommended stage."""
    if params_text is None and hf_config is None:
        raise ConfigError("--params is missing; give the parameter count (7B, 1.3B, 350M, ...) or the model's "
                          "transformers config with --hf CONFIG.json.")
    params = parse_count(params_text, field="--params") if params_text is not None else None
    shape = {"layers": layers, "hidden": hidden, "heads": heads, "seq": seq, "micro_batch": micro_batch}
    hf = None
    if hf_config is not None:
        from launch.commands.estimate_time import hf_model

        _hf_options(shape, vocab)
        _validate(gpus, tp, gpus_per_node, gpu_memory, headroom, dict.fromkeys(shape), None)
        hf = hf_model(hf_config, seq, micro_batch, tp, precision, params)
        params = hf.figures.params
    else:
        _validate(gpus, tp, gpus_per_node, gpu_memory, headroom, shape, vocab)
    host_bytes = size_option("--host-memory", host_memory, MAX_HOST_MEMORY_GB)
    nvme_bytes = size_option("--nvme", nvme_text, MAX_NVME_GB)
    timing = None
    if with_time:
        from launch.commands.estimate_time import rank_estimate

        timing = rank_estimate(params, gpus, tp, gpus_per_node, gpu_memory, precision, headroom, shape, vocab,
                               activation_checkpointing, gpu, gpu_tflops, intra, inter, intra_gbps, inter_gbps,
                               nics_per_node, global_batch, host_bytes, nvme_bytes, hf=hf)

    kind = activations = checkpointed = None
    if hf is not None:
        kind = "profile"
        activations = hf.figures.activation_bytes(micro_batch, tp, activation_checkpointing)
        checkpointed = hf.figures.activation_bytes(micro_batch, tp, checkpointing=True)
    elif shape["layers"] is not None:
        kind = "gpt" if vocab is not None else "korthikanti"
        activations = activation_estimate(kind, shape, vocab, tp, precision, activation_checkpointing)
        checkpointed = activation_estimate(kind, shape, vocab, tp, precision, checkpointing=True)

    prediction = gpt_params = None
    if vocab is not None:
        gpt_params, prediction = _gpt_prediction(vocab, shape, gpus // tp, tp, precision, activations)

    memory_bytes = float(Fraction(str(gpu_memory)) * 10**9)  # 24.3 GB is 24300000000 bytes, exactly
    # Without the flag the planner may still turn checkpointing on (after plain ZeRO-3, before offload). Its
    # PlanError names the fix itself (more GPUs, or for activations the sequence, micro-batch or TP degree).
    # A node's ranks share its host memory (the offloaded states): all --gpus-per-node of them, or, when the
    # node size is not given, at least the TP group, which lies inside one node.
    # NVMe offload is the guide's next row for a cluster not yet booked: weighed where CPU offload does not fit
    # the host memory (--host-memory), its disk checked when --nvme says how large it is.
    plan = choose_stage(params, gpus // tp, tp, memory_bytes, precision, activations or 0.0, headroom,
                        checkpointed_activation_bytes=checkpointed,
                        activation_checkpointing=True if activation_checkpointing else None,
                        ranks_per_node=gpus_per_node or tp, node_size_known=gpus_per_node is not None,
                        host_memory_bytes=host_bytes, nvme=True, nvme_bytes=nvme_bytes)
    if as_json:
        out = _as_json(params, gpu_memory, plan, activations, kind)
        if hf is not None:
            out["profile"] = hf.summary(micro_batch, tp)
        if prediction is not None:
            out["prediction"] = {str(s): p.as_dict() for s, p in prediction.items()}
            out["prediction_params"] = gpt_params
        if timing is not None:
            out["time"] = timing.as_dict()
        click.echo(json.dumps(out))
    else:
        if hf is not None:
            click.echo(hf.line(micro_batch, tp))
        click.echo(_as_table(params, precision, gpu_memory, plan, activations, kind, gpus_per_node))
        if prediction is not None:
            from launch.job.memory_view import prediction_lines

            note = _other_model_note(params, gpt_params)
            if note is not None:
                click.echo(note)

            for line in prediction_lines(prediction, plan.usable_bytes, "cuda"):
                click.echo(line)
        if timing is not None:
            for line in timing.lines():
                click.echo(line)


def _gpt_prediction(vocab: int, shape: dict, dp: int, tp: int, precision: str, activations: float) -> tuple:
    """``(parameter count, {stage: hybrid.plan.memory.predict_memory})`` for the built-in GPT of this shape with these
    activation bytes (``_activations``' "gpt" figure), on GPUs (the default runtime reserve included)."""
    from hybrid.plan.memory import DEFAULT_RUNTIME_RESERVE_GB, predict_memory
    from hybrid.models.gpt.model import GPT
    from hybrid.zero.units import model_units

    config = GPTConfig(vocab_size=vocab, seq_len=shape["seq"], n_layers=shape["layers"], hidden=shape["hidden"],
                       n_heads=shape["heads"])
    config.check_tp(tp)  # _check_split said these rules in the CLI's terms; any other is still the GPT's
    model = GPT(config, device="meta")
    units = model_units(model, tp)
    return sum(p.numel() for p in model.parameters()), {
        s: predict_memory(units, dp, s, precision, activations=activations,
                          runtime_reserve=DEFAULT_RUNTIME_RESERVE_GB * 10**9) for s in STAGES}


def _other_model_note(params: int, gpt_params: int) -> str | None:
    """When ``--params`` (the seed tables' Ψ) is not the built-in GPT's count to ``PARAMS_TOLERANCE``: a note that
    the two tables describe two models (``--params 7B`` for a 6.7B shape is a label; ``1B`` for it, a mistake)."""
    from launch.planning.model_size import PARAMS_TOLERANCE

    if abs(Fraction(params - gpt_params, gpt_params)) <= PARAMS_TOLERANCE:
        return None
    return (f"note: the prediction below is of the built-in GPT of this shape, {quantity(gpt_params, 'parameter')}; "
            f"the table above is of --params, {quantity(params, 'parameter')}.")
