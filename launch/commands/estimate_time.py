"""``hybrid estimate --time``: the layouts of a cluster not yet booked, ranked by predicted tokens/s.

``rank_estimate(...)`` builds what ``hybrid plan`` builds from a cluster file, from the estimate's options:
the hardware (``hybrid.plan.hardware.build_hardware`` from ``--gpu`` and the link options), the TP degrees
(divisors of the node size that split the heads and, with ``--vocab``, the vocabulary; ``--tp`` is the
default one the global batch is taken at), the stages and levers (``--activation-checkpointing`` forces it
on), micro-batch x accumulation keeping ``--global-batch`` (default ``--micro-batch`` x DP at ``--tp``; with
``--global-batch`` the micro-batch is chosen), and each layout's memory by the planner's rule with the
estimate's activation figure (the built-in GPT's with ``--vocab``, Korthikanti's without), a node's host memory
(``--host-memory``) and disk (``--nvme``) where given; offload is weighed to host memory and to NVMe. The node size is
``--gpus-per-node``, else 8 GPUs (a DGX/HGX node) or all of them when fewer, said in the output.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction
from typing import Optional

from hybrid.config import validate as v
from hybrid.errors import ConfigError
from hybrid.models.gpt.config import GPTConfig, shape_violation
from hybrid.plan.candidates import Ranking, describe, layouts, rank
from hybrid.plan.cost import Hardware, Layout, ModelShape
from hybrid.plan.hardware import GPU_ALIASES, build_hardware, gpu_spec
from hybrid.plan.memory import activation_bytes, gpt_activation_bytes
from hybrid.plan.planner import layout_option
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


def rank_estimate(params: int, gpus: int, tp: int, gpus_per_node: Optional[int], gpu_memory: float, precision: str,
                  headroom: float, shape: dict, vocab: Optional[int], checkpointing: bool, gpu: str,
                  gpu_tflops: Optional[float], intra: str, inter: str, intra_gbps: Optional[float],
                  inter_gbps: Optional[float], nics_per_node: Optional[int],
                  global_batch: Optional[int], host_memory_bytes: Optional[float] = None,
                  nvme_bytes: Optional[float] = None) -> EstimateTime:
    """The ranking (see the module docstring); options are checked here, each refusal one sentence."""
    if shape["layers"] is None:
        raise ConfigError("--time needs the model's shape: give --layers, --hidden, --heads, --seq and "
                          "--micro-batch (and --vocab for the built-in GPT's activation estimate).")
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
    model = ModelShape(params, shape["layers"], shape["hidden"], shape["heads"], shape["seq"], vocab or 0)
    tps = [d for d in range(node, 0, -1) if node % d == 0 and shape_violation(shape["hidden"], shape["heads"], d, vocab)
           is None]
    nodes = gpus // node
    memory_bytes = float(Fraction(str(gpu_memory)) * 10**9)
    kind = "gpt" if vocab is not None else "korthikanti"

    def memory(lay: Layout):
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
    is ``gpt_activation_bytes`` with the arguments ``launch.planning.plan.build_plan`` gives it for the built-in GPT
    of this shape (its default mlp_ratio), "korthikanti" the generic ``activation_bytes``."""
    s, b, h, a, n = (shape[k] for k in ("seq", "micro_batch", "hidden", "heads", "layers"))
    if kind == "gpt":
        return gpt_activation_bytes(s, b, h, a, n, vocab, tp=tp, precision=precision, mlp_ratio=GPTConfig.mlp_ratio,
                                    checkpointing=checkpointing)
    return activation_bytes(s, b, h, a, n, tp, checkpointing)
