"""``hybrid estimate --time``: the layouts of a cluster not yet booked, ranked by predicted tokens/s; and the model
of ``--hf`` (``hf_model``: a transformers config profiled on paper).

``rank_estimate(...)`` builds what ``hybrid plan`` builds from a cluster file, from the estimate's options:
the hardware (``hybrid.plan.hardware.build_hardware`` from ``--gpu`` and the link options), the TP degrees
(divisors of the node size that split the heads and, with ``--vocab``, the vocabulary; ``--tp`` is the
default one the global batch is taken at), the stages and levers (``--activation-checkpointing`` forces it
on), micro-batch x accumulation keeping ``--global-batch`` (default ``--micro-batch`` x DP at ``--tp``; with
``--global-batch`` the micro-batch is chosen), and each layout's memory by the planner's rule with the
estimate's figures (with ``--vocab`` the built-in GPT's profile: activations, FLOPs, recompute and eager ops, as
``hybrid plan`` takes them; without it Korthikanti's activations and the analytic FLOPs), a node's host memory
(``--host-memory``) and disk (``--nvme``) where given; offload is weighed to host memory and to NVMe. The node size is
``--gpus-per-node``, else 8 GPUs (a DGX/HGX node) or all of them when fewer, said in the output.

With ``--hf`` (``hf_model``) the model is a transformers config's causal LM, profiled on fake tensors
(``launch.planning.model_size.config_figures``: no weights, two layers scaled to all) at ``--seq`` in
``--precision``: Ψ, the activations of any micro-batch, TP degree and checkpointing, and the time model's FLOPs
per token, recompute and eager ops are the profile's (``hybrid plan`` takes the same for an ``hf:`` model); the TP
degrees are those the config splits (heads, KV heads, MLP, vocabulary: ``hybrid.tp.hf_config``).
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Any, Optional

from hybrid.config import validate as v
from hybrid.errors import ConfigError
from hybrid.models.gpt.config import GPTConfig, shape_violation
from hybrid.plan.candidates import Ranking, describe, layouts, rank
from hybrid.plan.cost import Hardware, Layout, ModelShape
from hybrid.plan.hardware import GPU_ALIASES, build_hardware, gpu_spec
from hybrid.plan.memory import activation_bytes
from hybrid.plan.planner import layout_option
from launch.planning.model_size import PARAMS_TOLERANCE, ModelFigures, config_figures, gpt_figures
from launch.planning.time_plan import ranking_dict, ranking_lines

DEFAULT_NODE = 8
MAX_GBPS = 1e6


@dataclass(frozen=True)
class EstimateTime:
    ranking: Ranking
    hardware: Hardware
    gpus_per_node: int
    node_note: str

    def lines(self) -> list[str]:
        r = self.ranking
        head = (f"global batch {r.global_batch} sequences per step, {self.node_note}; "
                + "; ".join(f"{k} {v}" for k, v in self.hardware.sources))
        out = [""] + ranking_lines(r, self.hardware, head)
        if r.chosen is None:
            return out + ["Fastest: none of the layouts fits"]
        c = r.chosen.cost
        out.append(f"Fastest: {describe(r.chosen.layout)}: {c.tokens_per_s_per_gpu:,.0f} tokens/s per GPU "
                   f"({c.tokens_per_s:,.0f} in all), step {c.step_s:.3g} s, MFU {c.mfu:.1%}")
        return out

    def as_dict(self) -> dict:
        out = ranking_dict(self.ranking, self.hardware)
        out["gpus_per_node"] = self.gpus_per_node
        return out


@dataclass(frozen=True)
class HfModel:
    """The model of ``--hf``: its transformers config and its figures at ``--seq`` (``hf_model``)."""

    path: Path
    config: Any
    figures: ModelFigures

    def tp_refusal(self, tp: int) -> Optional[str]:
        from hybrid.tp.hf_config import config_refusal

        return config_refusal(self.config, tp)

    def summary(self, micro_batch: int, tp: int) -> dict:
        f, plain = self.figures, self.figures.plain
        return {"config": str(self.path), "model": plain.model, "params": f.params, "layers": plain.layers,
                "width": plain.width, "seq": f.seq, "flops_per_token": plain.flops_per_token(f.seq),
                "activation_bytes": f.activation_bytes(micro_batch, tp),
                "checkpointed_activation_bytes": f.activation_bytes(micro_batch, tp, True)}

    def line(self, micro_batch: int, tp: int) -> str:
        d = self.summary(micro_batch, tp)
        return (f"Profile: {d['model']} of {self.path.name}, {d['layers']} blocks, {d['flops_per_token'] / 1e9:,.3g} "
                f"GFLOP per token (forward and backward) at {d['seq']:,} tokens, measured on fake tensors")


def hf_model(path_text: str, seq: Optional[int], micro_batch: Optional[int], tp: int, precision: str,
             stated_params: Optional[int]) -> HfModel:
    """``--hf``'s config read and profiled at ``seq`` (``--seq``), checked against ``--tp`` and ``--params``; each
    refusal one sentence."""
    from hybrid.models.hf import load_config

    for name, value in (("--seq", seq), ("--micro-batch", micro_batch)):
        if value is None:
            raise ConfigError(f"--hf needs {name} too: the activations and FLOPs are the profile's at the sequence "
                              "length and micro-batch; give --seq and --micro-batch.")
        v.positive_int(name, value)
    if seq < 2:
        raise v.invalid("--seq", "at least 2 tokens (the profile fits attention's terms from two lengths)", seq)
    path = Path(path_text).expanduser()
    path = path / "config.json" if path.is_dir() else path
    if not path.is_file():
        raise ConfigError(f"--hf is {v.quote(str(path))}, which is not a file; give the path of a transformers "
                          "config.json (or of the directory holding it).")
    config = load_config(path)
    limit = getattr(config, "max_position_embeddings", None)
    if isinstance(limit, int) and seq + 1 > limit:
        raise ConfigError(f"--seq is {seq}, but a row of seq + 1 tokens does not fit the model's "
                          f"max_position_embeddings ({limit}); use at most {limit - 1}.")
    from hybrid.tp.hf_config import config_refusal

    refusal = config_refusal(config, tp) if tp > 1 else None
    if refusal is not None:
        raise ConfigError(f"--tp ({tp}) cannot split the model of --hf: {refusal}.")
    model = HfModel(path, config, config_figures(config, seq, precision))
    counted = model.figures.params
    if stated_params is not None and abs(Fraction(stated_params - counted, counted)) > PARAMS_TOLERANCE:
        raise ConfigError(f"--params is {stated_params:,}, but the model of --hf has {counted:,} parameters (off by "
                          "more than 1%); leave --params out (the count is measured) or correct it.")
    return model


def rank_estimate(params: int, gpus: int, tp: int, gpus_per_node: Optional[int], gpu_memory: float, precision: str,
                  headroom: float, shape: dict, vocab: Optional[int], checkpointing: bool, gpu: str,
                  gpu_tflops: Optional[float], intra: str, inter: str, intra_gbps: Optional[float],
                  inter_gbps: Optional[float], nics_per_node: Optional[int],
                  global_batch: Optional[int], host_memory_bytes: Optional[float] = None,
                  nvme_bytes: Optional[float] = None, hf: Optional[HfModel] = None) -> EstimateTime:
    """The ranking (see the module docstring); options are checked here, each refusal one sentence. ``hf``: the
    model of ``--hf`` (its shape then comes from the profile, not from ``shape``'s layers, hidden and heads)."""
    if shape["layers"] is None and hf is None:
        raise ConfigError("--time needs the model's shape: give --layers, --hidden, --heads, --seq and "
                          "--micro-batch (and --vocab for the built-in GPT's activation estimate), or --hf CONFIG.json "
                          "with --seq and --micro-batch.")
    if gpu_spec(gpu) is None and gpu_tflops is None:
        raise v.invalid("--gpu", "a GPU the time model knows (" + ", ".join(sorted(GPU_ALIASES)) +
                        ", or an NVML name), or --gpu-tflops", gpu)
    if gpu_tflops is not None:
        v.positive_number("--gpu-tflops", gpu_tflops, 1e6, unit="TFLOP/s")
    for name, value in (("--intra-gbps", intra_gbps), ("--inter-gbps", inter_gbps)):
        if value is not None:
            v.positive_number(name, value, MAX_GBPS, unit="Gb/s")
    if nics_per_node is not None:
        v.positive_int("--nics-per-node", nics_per_node, 1024)
    node = gpus_per_node or min(gpus, DEFAULT_NODE)
    note = (f"nodes of {node} GPUs" if gpus_per_node else
            f"nodes of {node} GPUs (--gpus-per-node not given: {'a DGX/HGX node' if node == DEFAULT_NODE else 'one node'})")
    if gpus % node or node % tp:
        raise ConfigError(f"--time needs --gpus ({gpus}) to be whole nodes of {node} GPUs holding whole TP groups "
                          f"(--tp {tp}); give --gpus-per-node.")
    batch = global_batch
    if batch is not None:
        v.positive_int("--global-batch", batch)
    else:
        batch = shape["micro_batch"] * (gpus // tp)
    hw = build_hardware(gpu_spec(gpu).name if gpu_spec(gpu) else gpu, precision, intra, inter, node,
                        nics_per_node=nics_per_node, gpu_tflops=gpu_tflops, intra_gbps=intra_gbps,
                        inter_gbps=inter_gbps)
    if hf is not None:
        model = hf.figures.cost_shape()
        tps = [d for d in range(node, 0, -1) if node % d == 0 and hf.tp_refusal(d) is None]
    else:  # the built-in GPT of this shape (its profile, as hybrid plan takes it), else a declared shape's formulas
        model = (gpt_figures(gpt_shape(shape, vocab), precision, params).cost_shape() if vocab is not None else
                 ModelShape(params, shape["layers"], shape["hidden"], shape["heads"], shape["seq"], 0))
        tps = [d for d in range(node, 0, -1) if node % d == 0 and
               shape_violation(shape["hidden"], shape["heads"], d, vocab) is None]
    nodes = gpus // node
    memory_bytes = float(Fraction(str(gpu_memory)) * 10**9)
    kind = "gpt" if vocab is not None else "korthikanti"

    def memory(lay: Layout):
        if hf is not None:
            acts = hf.figures.activation_bytes(lay.micro_batch, lay.tp, lay.activation_checkpointing)
        else:
            acts = activation_estimate(kind, {**shape, "micro_batch": lay.micro_batch}, vocab, lay.tp, precision,
                                       lay.activation_checkpointing)
        return layout_option(params, lay.dp, lay.tp, lay.stage, memory_bytes, precision, acts, headroom,
                             activation_checkpointing=lay.activation_checkpointing, offload=lay.offload,
                             ranks_per_node=node, host_memory_bytes=host_memory_bytes, nvme=lay.nvme,
                             nvme_bytes=nvme_bytes)

    offered = []
    for t in tps:
        dp = gpus // t
        fixed = None if global_batch is not None else _gcd_micro(shape["micro_batch"], batch, dp)
        offered += layouts(nodes, node, precision, [t], (0, 1, 2, 3), (True,) if checkpointing else (False, True),
                           (False, True, "nvme"), batch, fixed)
    if not offered:
        raise ConfigError(f"--global-batch {batch} does not split over the DP degrees of these layouts "
                          f"({', '.join(str(gpus // t) for t in tps)}); use a multiple of them.")
    return EstimateTime(rank(model, offered, hw, memory), hw, node, note)


def _gcd_micro(micro: int, batch: int, dp: int) -> Optional[int]:
    import math

    return math.gcd(micro, batch // dp) if batch % dp == 0 else micro


def activation_estimate(kind: str, shape: dict, vocab: int | None, tp: int, precision: str, checkpointing: bool) -> float:
    """Activation bytes per GPU for one micro-batch by the estimate ``kind`` (a key of ``ESTIMATES``): "gpt"
    is the profile of the built-in GPT of this shape (``gpt_shape``), as ``launch.planning.plan.build_plan`` takes it,
    "korthikanti" the generic ``activation_bytes`` of a declared shape."""
    s, b, h, a, n = (shape[k] for k in ("seq", "micro_batch", "hidden", "heads", "layers"))
    if kind == "gpt":
        return gpt_figures(gpt_shape(shape, vocab), precision).activation_bytes(b, tp, checkpointing)
    return activation_bytes(s, b, h, a, n, tp, checkpointing)


def gpt_shape(shape: dict, vocab: int) -> dict:
    """The built-in GPT's config dict (``GPTConfig.to_dict()``) of the estimate's ``--layers``, ``--hidden``,
    ``--heads``, ``--seq`` and ``--vocab``."""
    return GPTConfig(vocab_size=vocab, seq_len=shape["seq"], n_layers=shape["layers"], hidden=shape["hidden"],
                     n_heads=shape["heads"]).to_dict()
