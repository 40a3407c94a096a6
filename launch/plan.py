"""Turn a validated spec (and, when Ray is up, the node probes) into a ``LaunchPlan``.

``build_plan(spec, reports=None)``: Ψ from the model config (counted on the meta device, nothing
allocated), TP degree (``parallel.tp`` or ``gpus_per_node``), DP = nodes·gpus_per_node/tp, per-GPU memory
from the NVML probes when every node measured its GPUs and otherwise the declared ``gpu_memory_gb`` (the
plan says which, and why), an activation estimate for one micro-batch, and ``hybrid.planner.choose_stage``
for the ZeRO stage. Without ``reports`` nothing touches Ray: that is ``hybrid plan``.

``mesh_layout`` is the pure rank layout (rank r on node r // gpus_per_node; TP groups of consecutive
ranks; DP groups of ranks with equal r % tp); ``plan_dict`` and ``format_plan`` render a plan.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

from hybrid.errors import ConfigError, PlanError
from hybrid.memory import GB, activation_bytes, parse_count
from hybrid.planner import Plan, choose_stage
from hybrid.yamlfile import load_yaml

BUILT_IN_ENTRYPOINT = "hybrid.models.gpt:train"
from launch.spec import LaunchSpec


@dataclass(frozen=True)
class MeshLayout:
    nodes: int
    ranks_per_node: int
    tp: int
    dp: int

    @property
    def node_ranks(self) -> list[list[int]]:
        g = self.ranks_per_node
        return [list(range(n * g, (n + 1) * g)) for n in range(self.nodes)]

    @property
    def tp_groups(self) -> list[list[int]]:
        return [list(range(k * self.tp, (k + 1) * self.tp)) for k in range(self.dp)]

    @property
    def dp_groups(self) -> list[list[int]]:
        return [list(range(j, self.tp * self.dp, self.tp)) for j in range(self.tp)]


def mesh_layout(nodes: int, ranks_per_node: int, tp: int) -> MeshLayout:
    if ranks_per_node % tp:
        raise ConfigError(f"parallel.tp is {tp}, which does not divide cluster.gpus_per_node = {ranks_per_node}; "
                          "use a divisor of gpus_per_node.")
    return MeshLayout(nodes, ranks_per_node, tp, nodes * ranks_per_node // tp)


@dataclass(frozen=True)
class LaunchPlan:
    spec: LaunchSpec
    params: int
    layout: MeshLayout
    plan: Plan
    memory_source: str  # "declared" or "measured"
    memory_note: str  # one sentence: where the per-GPU memory figure came from
    use_gpus: Optional[bool]  # None: not known without probing the cluster
    model: Optional[dict] = None  # the GPT shape when the model config is one

    @property
    def stage(self) -> int:
        return self.plan.stage

    @property
    def backend(self) -> str:
        if self.use_gpus is None:
            return "nccl with GPUs, gloo without (decided at launch)"
        return "nccl" if self.use_gpus else "gloo"


# ------------------------------------------------------------------------------------------- planning


def build_plan(spec: LaunchSpec, reports: Optional[Sequence] = None) -> LaunchPlan:
    """The plan for ``spec``; ``reports`` are ``launch.probe.NodeReport``s, or None to plan from declared
    facts alone."""
    cluster = spec.cluster
    layout = mesh_layout(cluster.nodes, cluster.gpus_per_node, spec.tp)
    params, model = model_size(spec)
    if model is not None:
        _check_tp(model, layout.tp)
    if reports is None:
        use_gpus, memory, source = None, cluster.gpu_memory_gb * GB, "declared"
        note = (f"planned from declared facts (no Ray cluster contacted): cluster.gpu_memory_gb = "
                f"{cluster.gpu_memory_gb:g} GB per GPU")
    else:
        use_gpus, memory, source, note = _memory_from_probes(spec, reports)
    activations = 0.0
    if model is not None:
        activations = activation_bytes(model["seq_len"], spec.job.micro_batch, model["hidden"], model["n_heads"],
                                       model["n_layers"], tp=layout.tp)
    plan = choose_stage(params, layout.dp, layout.tp, memory, precision=spec.parallel.precision,
                        activation_bytes=activations, forced_stage=spec.parallel.zero_stage)
    return LaunchPlan(spec, params, layout, plan, source, note, use_gpus, model)


def model_size(spec: LaunchSpec) -> tuple[int, Optional[dict]]:
    """Ψ of the model config: a GPT ``model:`` mapping counted on the meta device, or a plain ``params:``
    count (e.g. ``params: 7B``) for models the launcher cannot build itself."""
    from hybrid.models.gpt import GPTConfig, count_parameters

    path = spec.job.config
    doc = load_yaml(path, "model config")
    if isinstance(doc, dict) and "model" not in doc and "params" in doc:
        return parse_count(doc["params"], field=f"params in {path}"), None
    config = GPTConfig.from_yaml(path)
    if spec.job.entrypoint == BUILT_IN_ENTRYPOINT:  # its train: options too, before any rank starts
        from hybrid.models.gpt_train import train_options

        train_options(doc.get("train"))
    return count_parameters(config), config.to_dict()


def _check_tp(model: dict, tp: int) -> None:
    from hybrid.models.gpt import GPTConfig

    GPTConfig.from_dict(model).check_tp(tp)


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
                f"{smallest.total_bytes / GB:.1f} GB")
        return True, declared, "declared", (
            f"NVML unavailable on {len(unmeasured)} of {len(nodes)} GPU nodes ({unmeasured[0].probe.reason}); "
            f"using the declared cluster.gpu_memory_gb = {cluster.gpu_memory_gb:g} GB")
    cpu_nodes = [r for r in reports if r.cpus >= cluster.gpus_per_node]
    if len(cpu_nodes) < cluster.nodes:
        raise PlanError(f"cluster.nodes is {cluster.nodes}, but the Ray cluster has only {len(cpu_nodes)} nodes with "
                        f"{cluster.gpus_per_node} free CPUs (and {len(gpu_nodes)} with {cluster.gpus_per_node} GPUs); "
                        "lower cluster.nodes or gpus_per_node, or add nodes.")
    reason = reports[0].probe.reason if reports else "no nodes"
    return False, declared, "declared", (
        f"no GPUs in the Ray cluster (NVML on the first node: {reason}); ranks run on CPU with gloo and the plan "
        f"uses the declared cluster.gpu_memory_gb = {cluster.gpu_memory_gb:g} GB")


# ------------------------------------------------------------------------------------------ rendering


def plan_dict(lp: LaunchPlan) -> dict:
    """A JSON-ready description of the plan (what ``hybrid plan --json`` prints)."""
    c, p = lp.spec.cluster, lp.plan
    return {
        "cluster": {"address": c.address, "nodes": c.nodes, "gpus_per_node": c.gpus_per_node,
                    "interconnect": {"intra_node": c.intra_node, "inter_node": c.inter_node}},
        "model": {"config": str(lp.spec.job.config), "params": lp.params, "shape": lp.model},
        "mesh": {"world_size": c.world_size, "tp": lp.layout.tp, "dp": lp.layout.dp,
                 "nodes": [{"node": n, "ranks": r} for n, r in enumerate(lp.layout.node_ranks)],
                 "tp_groups": lp.layout.tp_groups, "dp_groups": lp.layout.dp_groups},
        "memory": {"source": lp.memory_source, "note": lp.memory_note, "gpu_memory_bytes": p.gpu_memory_bytes,
                   "usable_bytes": p.usable_bytes, "headroom": p.headroom, "activation_bytes": p.activation_bytes,
                   "precision": lp.spec.parallel.precision,
                   "stages": {str(s): {"params": b.params, "grads": b.grads, "optimizer": b.optimizer,
                                       "total": b.total, "with_activations": b.total + p.activation_bytes,
                                       "fits": p.fits[s]} for s, b in sorted(p.stages.items())}},
        "stage": p.stage, "offload": p.offload, "reason": p.reason,
        "requested_stage": "auto" if lp.spec.parallel.zero_stage is None else lp.spec.parallel.zero_stage,
        "backend": lp.backend,
    }


def format_plan(lp: LaunchPlan) -> str:
    """The plan as text: mesh, per-stage memory table, chosen stage and reason."""
    c, p, layout = lp.spec.cluster, lp.plan, lp.layout
    lines = [f"model   {lp.spec.job.config.name}: {lp.params:,} parameters, precision {lp.spec.parallel.precision}",
             f"mesh    {c.nodes} nodes x {c.gpus_per_node} ranks = {c.world_size} ranks; tp={layout.tp} (inside a node), "
             f"dp={layout.dp}; backend {lp.backend}"]
    lines += [f"  node {n}: ranks {_ranks(r)}" for n, r in enumerate(layout.node_ranks)]
    lines.append("  TP groups: " + " ".join(_group(g) for g in layout.tp_groups))
    lines.append("  DP groups: " + " ".join(_group(g) for g in layout.dp_groups))
    lines.append(f"memory  {lp.memory_note}; {human_bytes(p.usable_bytes)} usable per GPU "
                 f"({p.headroom:.0%} headroom), activations ~{human_bytes(p.activation_bytes)}")
    header = f"  {'stage':<6}{'params':>11}{'grads':>11}{'optimizer':>11}{'total':>11}{'+activ.':>11}  fits"
    lines.append(header)
    for s, b in sorted(p.stages.items()):
        mark = "  <- chosen" if s == p.stage else ""
        lines.append(f"  {s:<6}{human_bytes(b.params):>11}{human_bytes(b.grads):>11}{human_bytes(b.optimizer):>11}"
                     f"{human_bytes(b.total):>11}{human_bytes(b.total + p.activation_bytes):>11}  "
                     f"{'yes' if p.fits[s] else 'no':<4}{mark}")
    offload = " with optimizer states offloaded to CPU" if p.offload else ""
    lines.append(f"stage   ZeRO-{p.stage}{offload}: {p.reason}")
    return "\n".join(lines)


def human_bytes(n: float) -> str:
    n = float(n)
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"


def _ranks(ranks: list[int]) -> str:
    return f"{ranks[0]}-{ranks[-1]}" if len(ranks) > 2 else ",".join(map(str, ranks))


def _group(g: list[int]) -> str:
    return "[" + ",".join(map(str, g)) + "]"
