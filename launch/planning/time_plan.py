"""The plan's second axis: which of the layouts that fit trains fastest, from a cluster file and what was measured.

``rank_layouts(spec, facts, default_tp, ...)`` gathers what ``hybrid.plan.candidates`` needs: the model's
shape and activations (``launch.planning.model_size.ModelFigures``: the built-in GPT's formulas, any other
model's measured profile; a model that could not be profiled gets no time model and keeps the memory-only
choice, ``TimeModel.note`` says why), the TP degrees to weigh (``tp_options``), the global batch every candidate
keeps (``global_batch``), the hardware (``hybrid.plan.hardware.build_hardware``: ``probe.json``'s figures, else
cluster.yaml's declared ones, else the tables) and each layout's memory by the planner's rule
(``hybrid.plan.planner.layout_option`` with the model's activation estimate at its micro-batch, TP degree and
checkpointing). ``time_lines`` and ``time_dict``
render the ranking for ``hybrid plan`` (the top candidates as a table, with each term of the cost, and the
reason).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Optional

from hybrid.config.units import human_bytes
from hybrid.errors import ConfigError
from hybrid.plan.candidates import LINK_CHOICES, Ranking, describe, layouts, rank
from hybrid.plan.cost import DTYPE_BYTES, FLAT, Hardware, Layout, ModelShape
from hybrid.plan.hardware import build_hardware
from hybrid.plan.planner import DEFAULT_SUB_GROUP_SIZE, layout_option


@dataclass(frozen=True)
class TimeModel:
    """The ranking (None where there is no time model) and the note saying where its figures came from."""

    ranking: Optional[Ranking]
    hardware: Optional[Hardware]
    model: Optional[ModelShape]
    note: str
    calibration: float = 1.0  # the factor a run's measured step time applied to the compute efficiency

    @property
    def chosen(self):
        return self.ranking.chosen if self.ranking is not None else None


def global_batch(spec, dp_default: int) -> int:
    """Sequences per step: ``job.global_batch``, else ``job.micro_batch`` x DP at the default TP degree (what
    ``hybrid launch`` trained per step before the plan weighed other layouts)."""
    return spec.job.global_batch or spec.job.micro_batch * dp_default


def fixed_micro_batch(spec, dp: int, batch: int) -> Optional[int]:
    """The micro-batch at DP degree ``dp``: None (chosen per layout) with ``job.global_batch`` and no
    ``job.micro_batch``; ``job.micro_batch`` where it is given beside ``job.global_batch``; without
    ``job.global_batch`` the user's micro-batch where the rows allow it (the largest common divisor of it and
    the rows per rank), so the default TP degree runs exactly as written."""
    job = spec.job
    if job.micro_batch_auto:
        return None
    if job.global_batch is not None or batch % dp:
        return job.micro_batch
    return math.gcd(job.micro_batch, batch // dp)


def split_at(spec, dp: int, batch: int) -> tuple[int, int]:
    """``(micro_batch, accumulation)`` at DP degree ``dp`` when the plan does not choose (no time model):
    the fixed micro-batch, or the whole rows per rank in one micro-batch. ``ConfigError`` when the global
    batch does not split."""
    if batch % dp:
        raise ConfigError(f"job.global_batch is {batch}, which does not split over the {dp} DP ranks of this "
                          f"mesh; use a multiple of {dp}.")
    rows = batch // dp
    micro = fixed_micro_batch(spec, dp, batch) or rows
    if rows % micro:
        raise ConfigError(f"job.global_batch is {batch}: {rows} sequences per DP rank, which job.micro_batch = "
                          f"{micro} does not divide; make job.global_batch a multiple of {micro * dp} or change "
                          "job.micro_batch.")
    return micro, rows // micro


def device_name(spec, reports) -> Optional[str]:
    """The device the ranks compute on: the probed GPUs' NVML name, ``cpu`` where ranks run on CPU (no GPU
    probed; an embedded cluster when nothing is probed), else the declared ``cluster.gpu`` (None: unknown)."""
    if reports is not None:
        names = [g.name for r in reports if r.measured for g in r.probe.gpus]
        gpu_nodes = [r for r in reports if r.gpus >= spec.cluster.gpus_per_node]
        if len(gpu_nodes) < spec.cluster.nodes:
            return "cpu"
        return names[0] if names else spec.cluster.gpu
    return "cpu" if spec.cluster.is_local else spec.cluster.gpu


def hardware_for(spec, device: Optional[str], probe: Optional[dict] = None) -> Hardware:
    c = spec.cluster
    return build_hardware(device, spec.parallel.precision, _link(c.intra_node), _link(c.inter_node),
                          c.gpus_per_node, nics_per_node=c.nics_per_node, gpu_tflops=c.gpu_tflops,
                          intra_gbps=c.intra_node_gbps, inter_gbps=c.inter_node_gbps, probe=probe)


def _link(name: str) -> Optional[str]:
    return None if name == "unspecified" else name


def rank_layouts(spec, facts, tps: list, default_layout: Optional[Layout], gpu_memory_bytes: float,
                 host_memory_bytes: Optional[float], device: Optional[str], probe: Optional[dict] = None,
                 calibration: float = 1.0, extra_bytes: float = 0.0, headroom: float = 0.1,
                 nvme_bytes: Optional[float] = None, sub_group_size: int = DEFAULT_SUB_GROUP_SIZE,
                 figures=None) -> TimeModel:
    """The time model of ``spec`` over the TP degrees ``tps`` (see the module docstring); ``default_layout``
    is the memory-only choice (the reason compares with it), ``calibration`` a factor on the compute
    efficiency (``hybrid plan --measured``), ``extra_bytes`` what a run measured beyond its prediction;
    ``nvme_bytes`` a node's disk space for NVMe offload, weighed where ``cluster.nvme_path`` is set;
    ``figures``: ``model_size.model_figures(facts, precision)`` when the caller has them."""
    from launch.planning.model_size import model_figures

    c, par = spec.cluster, spec.parallel
    figures = figures if figures is not None else model_figures(facts, par.precision, spec.job.entrypoint)
    model = figures.cost_shape()
    if model is None:
        return TimeModel(None, None, None, f"time not estimated: {figures.note}; the memory-only choice")
    hw = hardware_for(spec, device, probe)
    if calibration != 1.0:
        hw = hw.scaled(calibration)
    if probe and probe.get("step_factor"):  # an embedded cluster's trial (launch.planning.trial_local)
        hw = hw.slowed(probe["step_factor"], f"x{probe['step_factor']:.3g} from {probe.get('trial', 'a trial')}")
    nodes, per_node = c.nodes, c.gpus_per_node
    batch = global_batch(spec, default_layout.dp if default_layout else nodes * per_node // tps[0])
    offered = []
    for tp in tps:
        dp = nodes * per_node // tp
        offered += layouts(nodes, per_node, par.precision, [tp], _choices(par.zero_stage, (0, 1, 2, 3)),
                           _choices(figures.checkpointing_lever(par.activation_checkpointing), (False, True)),
                           offload_choices(spec),
                           batch, fixed_micro_batch(spec, dp, batch), links=LINK_CHOICES)
    if not offered:
        dps = sorted({nodes * per_node // tp for tp in tps})
        raise ConfigError(f"job.global_batch is {batch}, which no layout splits: the DP degrees here are "
                          f"{', '.join(map(str, dps))} (and job.micro_batch must divide the rows per rank); use a "
                          f"multiple of {math.lcm(*dps)}.")

    def memory(lay: Layout):
        acts = figures.activation_bytes(lay.micro_batch, lay.tp, lay.activation_checkpointing)
        topology = lay.topology()
        return layout_option(facts.params, lay.dp, lay.tp, lay.stage, gpu_memory_bytes, par.precision, acts,
                             headroom, activation_checkpointing=lay.activation_checkpointing, offload=lay.offload,
                             host_memory_bytes=host_memory_bytes, ranks_per_node=per_node, extra_bytes=extra_bytes,
                             nvme=lay.nvme, nvme_bytes=nvme_bytes, sub_group_size=sub_group_size,
                             shard=topology.shard, secondary=topology.secondary)

    ranking = rank(model, offered, hw, memory, default_layout)
    where = "; ".join(f"{k} {v}" for k, v in hw.sources)
    if figures.plain is not None:
        where += f"; FLOPs, ops and activations {figures.source}"
    if calibration != 1.0:
        where += f"; compute efficiency calibrated from a run (x{calibration:.3g})"
    return TimeModel(ranking, hw, model, where, calibration)


def _choices(fixed, every: tuple) -> tuple:
    return every if fixed is None else (fixed,)


def offload_choices(spec) -> tuple:
    """The offload values weighed: ``parallel.offload`` when set, else none, host memory and, where
    ``cluster.nvme_path`` is set, the node's disk."""
    every = (False, True) + (("nvme",) if spec.cluster.nvme_path is not None else ())
    return _choices(spec.parallel.offload, every)


# ------------------------------------------------------------------------------------------- rendering

LABEL = 24  # the layout column's width, wider where a label needs it ("tp2 z3 mb 1x4 AC off 2-level+hpZ")


def header(width: int = LABEL) -> str:
    return (f"  {'layout':<{width}}{'mem/GPU':>10}{'compute':>9}{'TP':>8}{'DP':>8}{'offload':>8}{'optim':>8}"
            f"{'micro':>8}{'exposed':>9}{'step':>9}{'tokens/s':>12}{'MFU':>6}")


def time_lines(tm: TimeModel, with_reason: bool = True) -> list[str]:
    """The top candidates as a table (each cost term in ms), the chosen and the memory-only ones marked, and
    (``with_reason``) the reason; or the one line saying why there is no time model."""
    if tm.ranking is None:
        return [f"time    {tm.note}"]
    return ranking_lines(tm.ranking, tm.hardware, f"global batch {tm.ranking.global_batch} sequences per step; "
                                                  f"{tm.note}", with_reason) + link_lines(tm.ranking, tm.model)


def link_lines(r: Ranking, model: ModelShape) -> list[str]:
    """How each way of running ZeRO's collectives (``hybrid.plan.candidates.LINK_CHOICES``) loads the links for
    the chosen layout: per GPU and step, the bytes across nodes and inside them (also as multiples of Ψ/t, the
    GPU's share of the parameters in the model dtype), the DP time and the tokens/s, flat first."""
    ref = r.chosen or r.baseline
    if ref is None:
        return []
    base = dataclasses.replace(ref.layout, links=FLAT)
    same = [c for c in (*r.candidates, *r.lossy) if dataclasses.replace(c.layout, links=FLAT) == base]
    if len(same) < 2:
        return []
    psi = model.params / base.tp * DTYPE_BYTES[base.precision]
    lines = [f"links   ZeRO traffic per GPU and step of {describe(base)}, by how its collectives use the links "
             f"(Ψ/t = {human_bytes(psi)}):"]
    for c in sorted(same, key=lambda c: (c.layout.links != FLAT, c.cost.terms["dp_inter_bytes"])):
        t, lk = c.cost.terms, c.layout.links
        marks = [m for on, m in ((c is r.chosen, "chosen"), (lk == FLAT, "default"), (not c.fits, "does not fit"),
                                 (lk.quantized_weights or lk.quantized_gradients,
                                  "int8: yours to choose, zero.quantized_weights/gradients"))
                 if on]
        lines.append(f"  {lk.label or 'flat':<22} across nodes {human_bytes(t['dp_inter_bytes']):>9} "
                     f"({t['dp_inter_bytes'] / psi:.2f} Ψ/t)  inside {human_bytes(t['dp_intra_bytes']):>9} "
                     f"({t['dp_intra_bytes'] / psi:.2f} Ψ/t)  DP {_ms(c.cost.dp_s):>6} ms  "
                     f"{c.cost.tokens_per_s:>10,.0f} tokens/s" + (f"  <- {', '.join(marks)}" if marks else ""))
    return lines


def ranking_lines(r: Ranking, hw: Hardware, head: str, with_reason: bool = True) -> list[str]:
    """``time_lines`` of a ranking (``hybrid estimate --time`` prints it too)."""
    shown = r.top()
    width = max([LABEL] + [len(c.layout.label) + 1 for c in shown])
    lines = [f"time    {head}", header(width)]
    for cand in shown:
        c = cand.cost
        marks = [m for on, m in ((cand is r.chosen, "chosen"), (cand is r.baseline, "memory-only")) if on]
        lines.append(f"  {cand.layout.label:<{width}}{human_bytes(cand.device_bytes):>10}{_ms(c.compute_s):>9}"
                     f"{_ms(c.tp_s):>8}{_ms(c.dp_s):>8}{_ms(c.offload_s):>8}{_ms(c.optimizer_s):>8}"
                     f"{_ms(c.micro_s):>8}{_ms(c.exposed_s):>9}{_ms(c.step_s):>9}"
                     f"{c.tokens_per_s:>12,.0f}{c.mfu:>6.0%}"
                     + (f"  <- {', '.join(marks)}" if marks else ""))
    fitting, tried = len(r.fitting), len(r.candidates)
    lines.append(f"  ({fitting} of {tried} layouts fit; layout: TP degree, ZeRO stage, micro-batch x accumulation, "
                 f"AC, offload, how ZeRO's collectives use the links; times in ms per step and GPU (micro: what the "
                 f"micro-steps cost whatever their size, ops and passes over the parameters), MFU of "
                 f"{'the measured matmul rate' if hw.device == 'cpu' else 'the peak'})")
    if r.chosen is not None and with_reason:
        lines.append(f"choice  {r.reason}")
    return lines


def _ms(seconds: float) -> str:
    ms = seconds * 1e3
    return "-" if ms == 0 else f"{ms:.3g}" if ms < 100 else f"{ms:.0f}"


def time_dict(tm: TimeModel) -> dict:
    """``hybrid plan --json``'s ``time``: the note, the hardware figures, the chosen and top candidates."""
    if tm.ranking is None:
        return {"note": tm.note}
    return {"note": tm.note, "calibration": tm.calibration, **ranking_dict(tm.ranking, tm.hardware)}


def ranking_dict(r: Ranking, hw: Hardware) -> dict:
    return {"global_batch": r.global_batch, "reason": r.reason,
            "hardware": {"device": hw.device, "peak_flops": hw.peak_flops, "compute_efficiency": hw.compute_efficiency,
                         "optimizer_rate": hw.optimizer_rate, "intra_bandwidth": hw.intra.bandwidth,
                         "intra_latency": hw.intra.latency, "inter_bandwidth": hw.inter.bandwidth,
                         "inter_latency": hw.inter.latency, "pcie_bandwidth": hw.pcie.bandwidth,
                         "host_adam_rate": hw.host_adam_rate, "overlap": hw.overlap,
                         "sources": dict(hw.sources)},
            "chosen": r.chosen.as_dict() if r.chosen else None,
            "memory_only": r.baseline.as_dict() if r.baseline else None,
            "candidates": [c.as_dict() for c in r.top()], "fitting": len(r.fitting), "tried": len(r.candidates)}


