"""Turn a validated spec (and, when Ray is up, the node probes) into a ``LaunchPlan``.

``build_plan(spec, reports=None)``: Ψ measured from the model (``launch.planning.model_size``: the entrypoint's
``build_model`` hook on the meta device, nothing allocated; ``params:`` as a checked override), the TP
degree (``choose_tp``: ``parallel.tp``, or under ``auto`` for a model with tensor-parallel layers -- its own,
or split by a TP plan: ``parallel.tp_plan`` or a Hugging Face model's own -- the largest divisor of
gpus_per_node that splits it, and 1 for one without, said why), DP = nodes·gpus_per_node/tp, per-GPU memory
from the NVML probes when every node measured its GPUs and otherwise the declared ``gpu_memory_gb``, host
memory per node from
the probes (nodes sharing a machine share it) or the declared ``host_memory_gb`` (the plan says which,
and why), with ``cluster.nvme_path`` a node's disk space for NVMe offload's swap files
(``launch.planning.nvme_space``: probed, declared ``nvme_gb``, or this machine's for an embedded cluster),
activation estimates for one micro-batch with and without checkpointing (``model_size.model_figures``: the
built-in GPT's formulas, any other model's measured profile; where neither, none, and the plan says why), and
``hybrid.plan.planner.choose_stage`` for the ZeRO stage, activation checkpointing and offload
(``parallel.activation_checkpointing`` / ``parallel.offload``: auto is the planner's choice, NVMe offload
among its options where ``cluster.nvme_path`` is set). Without
``reports`` nothing touches Ray: that is ``hybrid plan``.

Time beside memory (``launch.planning.time_plan``): for a model whose figures are known (the built-in GPT, a
profiled model), every layout the job could run --
each TP degree that splits the model (``tp_options``; only ``parallel.tp`` when given), stage, lever and
micro-batch x accumulation keeping the global batch -- is costed (``hybrid.plan.cost``) and sized by the
planner's rule, and the fastest that fits is the plan: its TP degree makes the mesh, its stage and levers the
``Plan`` (``choose_stage`` at that stage and levers, with the ranking's reason), its micro-batch and
accumulation the ranks' (``LaunchPlan.micro_batch``, ``accumulation``); where it is the memory-only choice
the memory guide's plan and reason stand, and the ranking says why it is also the fastest. Where nothing is costed (a
model that could not be profiled) or nothing fits, the memory-only choice at the default TP degree stands, as before. ``probe`` (a
``probe.json``), ``calibration`` and ``extra_bytes`` (``hybrid plan --measured``) feed the ranking.

``mesh_layout`` is the plan's rank layout, a ``hybrid.comm.mesh.MeshLayout`` (rank r on node r // gpus_per_node;
TP groups of consecutive ranks; DP groups of ranks with equal r % tp), the groups the ranks' ``build_mesh``
creates; ``plan_dict`` and ``format_plan`` render a plan.
"""

from __future__ import annotations

import dataclasses
import uuid
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

from hybrid.comm.mesh import MeshLayout
from hybrid.errors import ConfigError, PlanError
from hybrid.plan.cost import FLAT, Layout, LinkOptions
from hybrid.plan.memory import GB
from hybrid.plan.planner import Plan, choose_stage, quantity
from hybrid.config.schema import echo
from hybrid.config.units import count, human_bytes
from launch.planning import time_plan
from launch.planning.model_size import ModelFacts, ModelFigures, gpt_figures, model_facts, model_figures
from launch.planning.nvme_space import nvme_space
from launch.spec import LaunchSpec


mesh_layout = MeshLayout.of  # the plan's rank layout (see the module docstring)


@dataclass(frozen=True)
class LaunchPlan:
    spec: LaunchSpec
    params: int
    layout: MeshLayout
    plan: Plan
    memory_source: str  # "declared" or "measured"
    memory_note: str  # one sentence: where the per-GPU memory figure came from
    use_gpus: Optional[bool]  # None: not known without probing the cluster
    model: Optional[dict] = None  # the GPT shape when the model is the built-in GPT
    tp_reason: str = ""  # why this TP degree
    params_source: str = ""  # how Ψ was found
    host_note: str = ""  # where the host memory figure came from
    tensor_parallel_layers: Optional[bool] = None  # None: not known (the model was not built)
    module: Any = field(default=None, compare=False, repr=False)  # the model on meta (units for the prediction)
    # Names this job to its ranks across attempts and re-plans (HYBRID_JOB_ID): an attempt waits longer for a
    # checkpoint lock an earlier attempt of its own job still holds (hybrid.checkpoint.lock).
    job_id: str = field(default_factory=lambda: uuid.uuid4().hex[:12], compare=False)
    micro_batch: Optional[int] = None  # per micro-step and DP rank; None: job.micro_batch
    accumulation: int = 1  # micro-steps per optimizer step
    time: Optional[time_plan.TimeModel] = field(default=None, compare=False, repr=False)
    # choose_stage at the default TP degree and the job's micro-batch: what memory alone picks (None: nothing fits)
    memory_plan: Optional[Plan] = field(default=None, compare=False, repr=False)
    links: LinkOptions = FLAT  # how ZeRO's collectives use the links (the time model's choice)
    nvme_note: str = ""  # where a node's NVMe space figure came from ("" without cluster.nvme_path)
    figures: Optional[ModelFigures] = field(default=None, compare=False, repr=False)  # activations, time shape

    def activation_bytes(self, micro_batch: int, checkpointing: bool = False) -> float:
        """Activation bytes per GPU of one micro-batch on this plan's TP degree (0 where not known), by the model's
        figures (the built-in GPT's: of its shape ``model``)."""
        figures = self.figures
        if self.model is not None:  # the shape the plan holds now (a re-plan may have replaced it): profiled once
            figures = gpt_figures(self.model, self.spec.parallel.precision, self.params)
        return figures.activation_bytes(micro_batch, self.layout.tp, checkpointing) if figures else 0.0

    @property
    def stage(self) -> int:
        return self.plan.stage

    @property
    def rows(self) -> int:
        """Micro-batch x accumulation: the sequences a DP rank trains per step."""
        return (self.micro_batch or self.spec.job.micro_batch) * self.accumulation

    @property
    def predicted(self):
        """The chosen layout's ``hybrid.plan.cost.StepCost``, or None without a time model."""
        chosen = self.time.chosen if self.time is not None else None
        return chosen.cost if chosen is not None else None

    @property
    def backend(self) -> str:
        if self.use_gpus is None:
            return "nccl with GPUs, gloo without (decided at launch)"
        return "nccl" if self.use_gpus else "gloo"


# ------------------------------------------------------------------------------------------- planning


def build_plan(spec: LaunchSpec, reports: Optional[Sequence] = None,
               facts: Optional[ModelFacts] = None, *, probe: Optional[dict] = None, calibration: float = 1.0,
               extra_bytes: float = 0.0) -> LaunchPlan:
    """The plan for ``spec``; ``reports`` are ``launch.ray.probe.NodeReport``s, or None to plan from declared
    facts alone; ``facts``: ``model_facts(spec)`` when the caller has them already; ``probe``,
    ``calibration``, ``extra_bytes``: what runs measured (``hybrid probe``, ``hybrid plan --measured``)."""
    cluster, parallel = spec.cluster, spec.parallel
    facts = facts if facts is not None else model_facts(spec)
    figures = model_figures(facts, parallel.precision, spec.job.entrypoint)
    tp, tp_reason = choose_tp(parallel.tp, cluster.gpus_per_node, cluster.world_size, facts)
    layout = mesh_layout(cluster.nodes, cluster.gpus_per_node, tp)
    _check_tp(facts, layout.tp)
    if reports is None:
        use_gpus, memory, source = None, cluster.gpu_memory_gb * GB, "declared"
        note = (f"planned from declared facts (no Ray cluster contacted): cluster.gpu_memory_gb = "
                f"{cluster.gpu_memory_gb:g} GB per GPU")
    else:
        use_gpus, memory, source, note = _memory_from_probes(spec, reports)
    host, host_note = host_memory(spec, reports)
    disk, nvme_note = nvme_space(spec, reports)
    batch = time_plan.global_batch(spec, layout.dp)
    plan, refusal, micro, accumulation = None, None, None, 1
    try:  # the memory-only choice at the default TP degree: the baseline, and the plan where time is not known
        micro, accumulation = time_plan.split_at(spec, layout.dp, batch)
        plan = _memory_plan(spec, facts, figures, layout, micro, memory, host, disk=disk)
    except ConfigError as err:  # the global batch does not split at the default TP degree: another may take it
        if figures.cost_shape() is None:
            raise
        refusal = err
    except PlanError as err:
        refusal = err
    baseline = None if plan is None else Layout(
        cluster.nodes, cluster.gpus_per_node, layout.tp, plan.stage, micro, accumulation,
        plan.activation_checkpointing, plan.offload, parallel.precision, nvme=plan.nvme)
    tm = time_plan.rank_layouts(spec, facts, tp_options(parallel.tp, cluster.gpus_per_node, facts, tp, figures),
                                baseline, memory, host, time_plan.device_name(spec, reports), probe, calibration,
                                extra_bytes, nvme_bytes=disk, sub_group_size=_sub_group_size(spec, facts), figures=figures)
    chosen = tm.chosen.layout if tm.chosen is not None else None
    memory_only = plan
    if chosen is None and plan is None:
        raise refusal
    if chosen is not None and chosen != baseline:  # time changed the layout: its reason is the plan's
        if chosen.tp != layout.tp:
            tp_reason = (f"tp {chosen.tp}: the fastest layout that fits (the default, {tp_reason}, is "
                         f"{_slower(tm, layout.tp)})")
            layout = mesh_layout(cluster.nodes, cluster.gpus_per_node, chosen.tp)
        micro, accumulation = chosen.micro_batch, chosen.accumulation
        plan = dataclasses.replace(_memory_plan(spec, facts, figures, layout, micro, memory, host, chosen, disk),
                                   reason=tm.ranking.reason)
    links = chosen.links if chosen is not None else FLAT
    return LaunchPlan(spec, facts.params, layout, plan, source, note, use_gpus, facts.shape, tp_reason,
                      facts.source, host_note, facts.tensor_parallel, facts.module, micro_batch=micro,
                      accumulation=accumulation, time=tm, memory_plan=memory_only, links=links,
                      nvme_note=nvme_note, figures=figures)


def _sub_group_size(spec: LaunchSpec, facts: ModelFacts) -> int:
    """``zero.sub_group_size`` the ranks will step with (the swap store's records)."""
    return _zero_sizes(spec, facts).sub_group_size


def _zero_sizes(spec: LaunchSpec, facts: ModelFacts):
    """The ``ZeroConfig`` of the model config's ``zero:`` before a stage is chosen, for its sizes (at stage 3,
    which takes every ``zero:`` option: the link options of a lower stage would be refused here)."""
    from launch.planning.replan import zero_config_of  # here: replan brings in torch (hybrid.runtime.train)

    return zero_config_of(spec, facts.shape, 3)


def _memory_plan(spec: LaunchSpec, facts: ModelFacts, figures: ModelFigures, layout: MeshLayout, micro_batch: int,
                 memory: float, host: Optional[float], chosen: Optional[Layout] = None,
                 disk: Optional[float] = None) -> Plan:
    """``choose_stage`` on ``layout`` with the model's activation estimate at ``micro_batch`` (``figures``): the
    user's levers, or ``chosen``'s stage and levers where the time model chose them; ``disk``: a node's NVMe
    space."""
    parallel = spec.parallel
    activations, checkpointed = 0.0, None
    if figures.known:
        activations = figures.activation_bytes(micro_batch, layout.tp)
        if figures.checkpointing_lever(parallel.activation_checkpointing) is not False:
            checkpointed = figures.activation_bytes(micro_batch, layout.tp, checkpointing=True)
    stage, offload, ac = parallel.zero_stage, parallel.offload, figures.checkpointing_lever(
        parallel.activation_checkpointing)
    shard, secondary = None, 1
    if chosen is not None:
        stage, ac = chosen.stage, chosen.activation_checkpointing
        offload = "nvme" if chosen.offload and chosen.nvme else chosen.offload
        topology = chosen.topology()
        shard, secondary = topology.shard, topology.secondary
    zero = _zero_sizes(spec, facts)
    return choose_stage(facts.params, layout.dp, layout.tp, memory, precision=parallel.precision,
                        activation_bytes=activations, forced_stage=stage,
                        checkpointed_activation_bytes=checkpointed, offload=offload,
                        activation_checkpointing=ac, host_memory_bytes=host,
                        ranks_per_node=spec.cluster.gpus_per_node, reduce_dtype=zero.reduce_dtype,
                        nvme=spec.cluster.nvme_path is not None, nvme_bytes=disk,
                        sub_group_size=zero.sub_group_size, shard=shard, secondary=secondary)


def _slower(tm, tp: int) -> str:
    best = [c for c in tm.ranking.fitting if c.layout.tp == tp]
    if not best:
        return "of layouts none of which fits"
    return f"{tm.chosen.cost.tokens_per_s / best[0].cost.tokens_per_s:.2f}x slower at its best"


def tp_options(requested: Optional[int], gpus_per_node: int, facts: ModelFacts, default: int,
               figures: Optional[ModelFigures] = None) -> list[int]:
    """The TP degrees the time model weighs: ``parallel.tp`` when given; for a model with TP layers whose figures
    are known (the built-in GPT; a profiled model: ``figures``) every divisor of gpus_per_node that splits it;
    else the default degree alone (``choose_tp``'s)."""
    timed = facts.shape is not None or (figures is not None and figures.known)
    if requested is not None or not facts.tensor_parallel or not timed:
        return [default]
    return [d for d in range(gpus_per_node, 0, -1) if gpus_per_node % d == 0 and facts.tp_refusal(d) is None]


def choose_tp(requested: Optional[int], gpus_per_node: int, world_size: int, facts: ModelFacts) -> tuple[int, str]:
    """The TP degree and why: ``parallel.tp`` as given, else for a model with TP layers (its own, or split by a
    TP plan: ``facts.tp_plan``) the largest divisor of gpus_per_node that splits it (``facts.tp_refusal``: the
    built-in GPT's shape, the split sizes and attention heads of a planned model; a model built without
    either is taken to split any way)."""
    if requested is not None:
        if requested > 1 and facts.tensor_parallel is False:
            own = f" (its own TP plan cannot be used: {facts.tp_note})" if facts.tp_note else ""
            raise ConfigError(f"parallel.tp is {requested}, but the model has no tensor-parallel layers (no "
                              f"parameter is marked tensor-parallel, hybrid.weights.attrs){own}, so its TP ranks "
                              "would all compute the same thing; set parallel.tp to 1 or auto.")
        by = f", split by {facts.tp_plan}" if requested > 1 and facts.tp_plan else ""  # with what it did beyond
        return requested, f"tp {requested} as requested (parallel.tp){by}"
    if facts.tensor_parallel:
        refusals = {}
        for tp in (d for d in range(gpus_per_node, 0, -1) if gpus_per_node % d == 0):
            refusals[tp] = facts.tp_refusal(tp)
            if refusals[tp] is None:
                break
        if tp == gpus_per_node:
            if tp == 1:
                return tp, "tp auto: 1 = gpus_per_node"
            if facts.tp_plan:
                return tp, f"tp auto: {tp} = gpus_per_node, since {facts.tp_plan} splits the model"
            return tp, f"tp auto: {tp} = gpus_per_node, since the model has tensor-parallel layers"
        by = f" by {facts.tp_plan}" if facts.tp_plan else ""
        return tp, (f"tp auto: {tp}, the largest divisor of gpus_per_node={gpus_per_node} that splits the model{by} "
                    f"(tp {gpus_per_node}: {refusals[gpus_per_node]})")
    if facts.tp_note:
        why = f"the model has no tensor-parallel layers and its own TP plan cannot be used ({facts.tp_note})"
    elif facts.tensor_parallel is False:
        why = "the model has no tensor-parallel layers (no parameter is marked tensor-parallel)"
    else:
        why = ("the model was not built on the driver (a params: count without a build_model hook), so whether it "
               "has tensor-parallel layers is unknown; set parallel.tp to use TP")
    return 1, f"tp auto: 1, since {why}; DP spans all {world_size} ranks"


def host_memory(spec: LaunchSpec, reports: Optional[Sequence]) -> tuple[Optional[float], str]:
    """Host memory per node for offloaded optimizer states, and where the figure came from: the smallest
    probed node (Ray nodes on one machine, same IP, share its memory), else the declared
    ``cluster.host_memory_gb``, else None (not checked)."""
    declared = spec.cluster.host_memory_gb
    if reports and all(r.host_memory_bytes for r in reports):
        sharing = Counter(r.ip for r in reports)
        share = {r.node_id: r.host_memory_bytes / sharing[r.ip] for r in reports}
        smallest = min(reports, key=lambda r: share[r.node_id])
        shared = (f", shared by the {sharing[smallest.ip]} Ray nodes at {smallest.ip}"
                  if sharing[smallest.ip] > 1 else "")
        return share[smallest.node_id], (f"host memory probed: {human_bytes(share[smallest.node_id])} available "
                                         f"per node (smallest node{shared})")
    if declared is not None:
        return declared * GB, f"host memory declared: cluster.host_memory_gb = {declared:g} GB per node"
    return None, "host memory unknown (declare cluster.host_memory_gb to check it when planning offline)"


def _check_tp(facts: ModelFacts, tp: int) -> None:
    refusal = facts.tp_refusal(tp) if tp > 1 else None
    if refusal is not None:
        raise ConfigError(f"parallel.tp={tp} cannot split this model: {refusal}; set parallel.tp to a divisor "
                          f"of gpus_per_node that works, or auto.")


def _memory_from_probes(spec: LaunchSpec, reports: Sequence) -> tuple[bool, float, str, str]:
    cluster = spec.cluster
    declared = cluster.gpu_memory_gb * GB
    gpu_nodes = [r for r in reports if r.gpus >= cluster.gpus_per_node]
    if len(gpu_nodes) >= cluster.nodes:
        nodes = gpu_nodes
        unmeasured = [r for r in nodes if not r.measured]
        if not unmeasured:
            smallest = min((g for r in nodes for g in r.probe.gpus), key=lambda g: g.total_bytes)
            return True, float(smallest.total_bytes), "measured", (
                f"measured by NVML on {len(nodes)} nodes: smallest GPU is {smallest.name} with "
                f"{human_bytes(smallest.total_bytes)}")
        return True, declared, "declared", (
            f"NVML unavailable on {len(unmeasured)} of {len(nodes)} GPU nodes ({unmeasured[0].probe.reason}); "
            f"using the declared cluster.gpu_memory_gb = {cluster.gpu_memory_gb:g} GB")
    cpu_nodes = [r for r in reports if r.cpus >= cluster.gpus_per_node]
    if len(cpu_nodes) < cluster.nodes:
        raise PlanError(f"cluster.nodes is {cluster.nodes}, but the Ray cluster has only {len(cpu_nodes)} nodes with "
                        f"{cluster.gpus_per_node} CPUs (and {len(gpu_nodes)} with {cluster.gpus_per_node} GPUs); "
                        "lower cluster.nodes or gpus_per_node, or add nodes.")
    reason = reports[0].probe.reason if reports else "no nodes"
    return False, declared, "declared", (
        f"no GPUs in the Ray cluster (NVML on the first node: {reason}); ranks run on CPU with gloo and the plan "
        f"uses the declared cluster.gpu_memory_gb = {cluster.gpu_memory_gb:g} GB")


# ------------------------------------------------------------------------------------------ rendering


def plan_dict(lp: LaunchPlan) -> dict:
    """A JSON-ready description of the plan (what ``hybrid plan --json`` prints)."""
    c, p, par = lp.spec.cluster, lp.plan, lp.spec.parallel
    echoed = echo(par)  # the parallel section as the user wrote it (auto for what the plan chooses)
    return {
        "cluster": {"address": c.address, "nodes": c.nodes, "gpus_per_node": c.gpus_per_node,
                    "interconnect": {"intra_node": c.intra_node, "inter_node": c.inter_node}},
        "model": {"config": str(lp.spec.job.config), "params": lp.params, "shape": lp.model,
                  "params_source": lp.params_source, "tensor_parallel_layers": lp.tensor_parallel_layers},
        "mesh": {"world_size": c.world_size, "tp": lp.layout.tp, "dp": lp.layout.dp, "tp_reason": lp.tp_reason,
                 "nodes": [{"node": n, "ranks": r} for n, r in enumerate(lp.layout.node_ranks)],
                 "tp_groups": lp.layout.tp_groups, "dp_groups": lp.layout.dp_groups},
        "memory": {"source": lp.memory_source, "note": lp.memory_note, "gpu_memory_bytes": p.gpu_memory_bytes,
                   "usable_bytes": p.usable_bytes, "headroom": p.headroom, "activation_bytes": p.activation_bytes,
                   "checkpointed_activation_bytes": p.checkpointed_activation_bytes,
                   "activations_source": lp.figures.source if lp.figures else "",
                   "activations_note": lp.figures.note if lp.figures else "",
                   "precision": par.precision, "per_gpu_bytes": p.per_gpu_bytes,
                   "host": {"note": lp.host_note, "host_memory_bytes": p.host_memory_bytes,
                            "per_rank_bytes": p.host_bytes, "per_node_bytes": p.host_bytes_per_node},
                   "nvme": nvme_dict(lp),
                   "stages": {str(s): {"params": b.params, "grads": b.grads, "optimizer": b.optimizer,
                                       "total": b.total, "with_activations": b.total + p.activation_bytes,
                                       "fits": p.fits[s]} for s, b in sorted(p.stages.items())},
                   "options": [{"stage": o.stage, "activation_checkpointing": o.activation_checkpointing,
                                "offload": o.offload, "nvme": o.nvme, "device_bytes": o.device_bytes,
                                "host_bytes": o.host_bytes, "disk_bytes": o.disk_bytes, "fits": o.fits}
                               for o in p.options]},
        "stage": p.stage, "offload": p.offload, "offload_device": p.offload_device,
        "activation_checkpointing": p.activation_checkpointing,
        "reason": p.reason,
        **{f"requested_{key}": echoed[name] for key, name in (("stage", "zero_stage"), ("offload", "offload"),
                                                               ("activation_checkpointing", "activation_checkpointing"))},
        "backend": lp.backend,
        "batch": {"micro_batch": lp.micro_batch, "accumulation": lp.accumulation,
                  "global_batch": lp.rows * lp.layout.dp},
        "time": time_plan.time_dict(lp.time) if lp.time is not None else None,
    }


def format_plan(lp: LaunchPlan) -> str:
    """The plan as text: model, mesh (and why this TP degree), per-stage memory table, the levers tried,
    the chosen stage and levers, and the reason."""
    c, p, layout, par = lp.spec.cluster, lp.plan, lp.layout, lp.spec.parallel
    lines = [f"model   {lp.spec.job.config.name}: {quantity(lp.params, 'parameter')} ({lp.params_source}), precision "
             f"{par.precision}",
             f"mesh    {count(c.nodes, 'node')} x {count(c.gpus_per_node, 'rank')} = {count(c.world_size, 'rank')}; tp={layout.tp} (inside a node), "
             f"dp={layout.dp}; backend {lp.backend}",
             f"  {lp.tp_reason}"]
    lines += [f"  node {n}: ranks {_ranks(r)}" for n, r in enumerate(layout.node_ranks)]
    lines.append("  TP groups: " + " ".join(_group(g) for g in layout.tp_groups))
    lines.append("  DP groups: " + " ".join(_group(g) for g in layout.dp_groups))
    checkpointed = ("" if p.checkpointed_activation_bytes is None else
                    f" ({human_bytes(p.checkpointed_activation_bytes)} with checkpointing)")
    known = lp.figures.known if lp.figures is not None else lp.model is not None
    activations = (f"activations ~{human_bytes(p.activation_bytes)}{checkpointed}" if known else
                   f"activations not estimated: {lp.figures.note if lp.figures else 'the model is not known'}")
    if known and lp.figures is not None and lp.figures.plain is not None:
        activations += f" ({lp.figures.source})"
    lines.append(f"memory  {lp.memory_note}; {human_bytes(p.usable_bytes)} usable per GPU "
                 f"({p.headroom:.0%} headroom), {activations}")
    lines.append(f"  {lp.host_note}")
    if lp.nvme_note:
        lines.append(f"  {lp.nvme_note}")
    header = f"  {'stage':<6}{'params':>11}{'grads':>11}{'optimizer':>11}{'total':>11}{'+activ.':>11}  fits"
    lines.append(header)
    plain = not (p.offload or p.activation_checkpointing)
    for s, b in sorted(p.stages.items()):
        mark = "  <- chosen" if s == p.stage and plain else ""
        lines.append(f"  {s:<6}{human_bytes(b.params):>11}{human_bytes(b.grads):>11}{human_bytes(b.optimizer):>11}"
                     f"{human_bytes(b.total):>11}{human_bytes(b.total + p.activation_bytes):>11}  "
                     f"{'yes' if p.fits[s] else 'no':<4}{mark}")
    levers = [o for o in p.options if o.offload or o.activation_checkpointing]
    if levers:
        disks = any(o.nvme for o in levers)
        lines.append(f"  {'with levers':<17}{'GPU':>11}{'host/node':>11}" + (f"{'disk/node':>11}" if disks else "") +
                     "  fits")
        for o in levers:
            chosen = (o.stage, o.offload, o.nvme, o.activation_checkpointing) == \
                (p.stage, p.offload, p.nvme, p.activation_checkpointing)
            host = human_bytes(o.host_bytes * p.ranks_per_node) if o.offload else "-"
            disk = (f"{human_bytes(o.disk_bytes * p.ranks_per_node) if o.nvme else '-':>11}" if disks else "")
            lines.append(f"  {o.label:<17}{human_bytes(o.device_bytes):>11}{host:>11}{disk}  "
                         f"{'yes' if o.fits else 'no':<4}{'  <- chosen' if chosen else ''}")
    written = {k: str(value).lower() if isinstance(value, bool) else value for k, value in echo(par).items()}
    offload = "on, to NVMe" if p.nvme else _on(p.offload)
    own_loop = ("; not weighed: the job's own loop applies it only where it is true"
                if lp.figures is not None and par.activation_checkpointing is None and not lp.figures.checkpointing
                else "")
    lines.append(f"levers  activation checkpointing {_on(p.activation_checkpointing)} "
                 f"(parallel.activation_checkpointing: {written['activation_checkpointing']}{own_loop}), "
                 f"optimizer offload {offload} (parallel.offload: {written['offload']})")
    lines.append(f"stage   ZeRO-{p.stage}{_with_levers(p)}: {p.reason}")
    if p.nvme:
        lines.append(f"nvme    {_nvme_line(lp)}")
    lines.append(f"batch   micro-batch {lp.micro_batch} x {lp.accumulation} accumulation per DP rank = global batch "
                 f"{lp.rows * layout.dp} sequences per step" + ("" if par.tp is not None or lp.time is None else
                                                                   "; TP degree, stage, levers and micro-batch "
                                                                   "weighed by time below"))
    if lp.time is not None:
        lines += time_plan.time_lines(lp.time, with_reason=lp.time.ranking is not None and
                                      lp.plan.reason != lp.time.ranking.reason)
    return "\n".join(lines)


def nvme_dict(lp: LaunchPlan) -> Optional[dict]:
    """``hybrid plan --json``'s ``memory.nvme``: the disk's figures and, with NVMe offload, the swap files' bytes
    and a step's traffic and disk time (the time model's, where there is one); None without an NVMe path."""
    p, path = lp.plan, lp.spec.cluster.nvme_path
    if path is None:
        return None
    out = {"path": str(path), "note": lp.nvme_note, "nvme_bytes": p.nvme_bytes}
    if p.nvme:
        cost = lp.predicted
        out.update({"per_rank_bytes": p.disk_bytes, "per_node_bytes": p.disk_bytes_per_node,
                    "read_bytes_per_step": p.disk_bytes, "write_bytes_per_step": p.disk_bytes,
                    "disk_s": cost.nvme_s if cost is not None and cost.layout.nvme else None})
    return out


def _nvme_line(lp: LaunchPlan) -> str:
    """The swap files' bytes per rank and node, what a step reads and writes, and the disk's time for it."""
    p, n = lp.plan, lp.plan.ranks_per_node
    room = "" if p.nvme_bytes is None else f" of {human_bytes(p.nvme_bytes * (1 - p.headroom))} usable"
    line = (f"swap files under {lp.spec.cluster.nvme_path}: {human_bytes(p.disk_bytes)} per rank x {n} = "
            f"{human_bytes(p.disk_bytes_per_node)} per node{room}; each step reads and writes "
            f"{human_bytes(p.disk_bytes)} per rank ({human_bytes(p.disk_bytes_per_node)} per node) each way")
    cost = lp.predicted
    if cost is not None and cost.layout.nvme:
        line += f", {cost.nvme_s:.3g} s on the node's disk (the time model's, overlapped with the host's step)"
    return line


def _with_levers(p: Plan) -> str:
    parts = [text for on, text in ((p.offload, f"optimizer states offloaded to {'NVMe' if p.nvme else 'CPU'}"),
                                   (p.activation_checkpointing, "activation checkpointing")) if on]
    return f" with {' and '.join(parts)}" if parts else ""


def _on(value: bool) -> str:
    return "on" if value else "off"


def _ranks(ranks: list[int]) -> str:
    return f"{ranks[0]}-{ranks[-1]}" if len(ranks) > 2 else ",".join(map(str, ranks))


def _group(g: list[int]) -> str:
    return "[" + ",".join(map(str, g)) + "]"
