"""The closed loop's decisions: what a plan is predicted to hold per rank, and the plan to switch to when a
rank measured more than its budget.

``Choice`` is what a re-plan may change: the ZeRO stage, activation checkpointing, optimizer offload, and
the micro-batch with its gradient accumulation (their product, the rows a rank trains per step, never
changes, so the global batch is the same). ``predict(lp, choice)`` is ``hybrid.plan.memory.predict_memory`` for
the plan's model (the built-in GPT's real parameter tree; a bare ``params:`` count as one flat module) on
the plan's device: ``cpu`` predicts the peak RSS growth a CPU rank measures.

``ladder(lp, current)`` lists the candidates in the order the issue fixes -- the next stages, then
activation checkpointing, then offload, then halving the micro-batch (doubling the accumulation) -- each
rung keeping what the ones before it turned on. Activation checkpointing is a rung only where
``JobSettings`` carries ``activation_checkpointing`` and the GPT config can take it; offload only where the
engine's ``ZeroConfig`` has an offload field and the ranks run on GPUs (on CPU the host *is* the device); the
micro-batch rungs only for a GPT model config (the built-in GPT trains ``micro_batch × accumulation`` rows
per step as ``accumulation`` micro-batches; an entrypoint of its own would have to read both settings).
``replan(lp, current, overshoot)`` corrects every candidate by what the measurement showed beyond the
prediction (``Overshoot.extra``: memory the planner cannot see, such as an entrypoint's own buffers) and
returns the fastest that fits the usable budget by the plan's time model (``by_time``: the ranking of
``hybrid plan``; the ladder's order where there is none or the times tie), or raises ``NothingFits`` with one sentence naming the
smallest configuration that would (more nodes, offload, a smaller micro-batch).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import lru_cache
from typing import Optional

from hybrid.errors import JobError
from hybrid.plan.memory import (DEFAULT_CPU_RUNTIME_RESERVE_GB, DEFAULT_RUNTIME_RESERVE_GB, GB, MemoryPrediction,
                           ModelUnits, predict_memory)
from hybrid.runtime.train import JobSettings
from hybrid.zero.units import model_units
from hybrid.config.units import human_bytes

MAX_NODES_SEARCHED = 4096


class NothingFits(JobError):
    """No plan on the ladder fits the measured figures; the message names what would."""


@dataclass(frozen=True)
class Choice:
    stage: int
    micro_batch: int
    accumulation: int = 1
    activation_checkpointing: bool = False
    offload: bool = False
    nvme: bool = False  # with offload: the optimizer states on each node's disk (cluster.nvme_path)

    def describe(self) -> str:
        parts = [f"stage {self.stage}"]
        if self.activation_checkpointing:
            parts.append("activation checkpointing")
        if self.offload:
            parts.append("optimizer offload to NVMe" if self.nvme else "optimizer offload")
        if self.accumulation > 1:
            parts.append(f"micro-batch {self.micro_batch} x {self.accumulation} accumulation steps")
        return parts[0] + (" with " + ", ".join(parts[1:]) if len(parts) > 1 else "")

    def settings(self, base: JobSettings) -> JobSettings:
        """``base`` with this choice applied (fields the settings lack are left out)."""
        fields = {f.name for f in dataclasses.fields(JobSettings)}
        values = {"stage": self.stage, "micro_batch": self.micro_batch,
                  "gradient_accumulation_steps": self.accumulation,
                  "offload": "nvme" if self.offload and self.nvme else self.offload,
                  "activation_checkpointing": self.activation_checkpointing}
        return dataclasses.replace(base, **{k: x for k, x in values.items() if k in fields})


@dataclass(frozen=True)
class Overshoot:
    """What one rank measured against its budget when it ran out (or went over)."""

    rank: int
    measured: float   # bytes: the rank's peak (its budget when CUDA raised before a measurement)
    budget: float
    predicted: float  # the prediction of the plan it ran
    step: int         # the step it reached

    @property
    def extra(self) -> float:
        """Bytes beyond the prediction: held by every candidate too."""
        return max(0.0, self.measured - self.predicted)


def planned_choice(lp) -> Choice:
    """The planner's choice as it stands (``hybrid.plan.planner``: model states and activations)."""
    return Choice(lp.stage, lp.micro_batch or lp.spec.job.micro_batch, lp.accumulation,
                  lp.plan.activation_checkpointing, lp.plan.offload, lp.plan.nvme)


def initial_choice(lp) -> Choice:
    """What the job starts with: the planner's choice, unless the stage was left on auto and the complete
    prediction (buckets and gathered units in flight, the runtime reserve) says it does not fit while a rung
    above it does -- then that rung, instead of an out-of-memory restart after the first steps."""
    planned = planned_choice(lp)
    if lp.spec.parallel.zero_stage is not None:
        return planned
    usable = usable_bytes(lp)
    if predict(lp, planned).total <= usable:
        return planned
    return next((c for c in by_time(lp, ladder(lp, planned)) if predict(lp, c).total <= usable), planned)


def start_note(lp) -> Optional[str]:
    """One line when the job starts above the planner's choice (``initial_choice``), or when what it starts with
    exceeds the usable budget by the complete prediction (a stage the user forced, or no rung that fits);
    else None."""
    planned, start = planned_choice(lp), initial_choice(lp)
    usable = usable_bytes(lp)
    if start != planned:
        return (f"starting at {start.describe()} (predicted {human_bytes(predict(lp, start).total)}), not the "
                f"planner's {planned.describe()}: its complete prediction, {human_bytes(predict(lp, planned).total)}, "
                f"exceeds the {human_bytes(usable)} usable")
    predicted = predict(lp, start).total
    if predicted <= usable:
        return None
    why = ("parallel.zero_stage is set, so no other stage is tried" if lp.spec.parallel.zero_stage is not None
           else "no other option on the ladder fits either")
    return (f"warning: {start.describe()} is predicted to need {human_bytes(predicted)}, more than the "
            f"{human_bytes(usable)} usable ({why}); starting anyway, and a rank that runs out of memory makes the "
            "job re-plan or stop")


def device_of(lp) -> str:
    """``cpu`` when the ranks run on CPU (known after probing; for ``hybrid plan``, an embedded cluster)."""
    if lp.use_gpus is None:
        return "cpu" if lp.spec.cluster.is_local else "cuda"
    return "cuda" if lp.use_gpus else "cpu"


def runtime_reserve(lp) -> float:
    gb = lp.spec.cluster.runtime_reserve_gb
    if gb is None:
        gb = DEFAULT_CPU_RUNTIME_RESERVE_GB if device_of(lp) == "cpu" else DEFAULT_RUNTIME_RESERVE_GB
    return gb * GB


def budget_bytes(lp) -> float:
    """A rank's budget: the GPU's memory the plan uses (NVML's where measured), the declared one on CPU."""
    return float(lp.plan.gpu_memory_bytes)


def usable_bytes(lp) -> float:
    return budget_bytes(lp) * (1 - lp.plan.headroom)


@lru_cache(maxsize=16)
def _gpt_units(shape: tuple, tp: int, stage3_unit) -> ModelUnits:
    """``model_units`` of the GPT of ``shape`` as one TP rank of ``tp`` holds it (meta, nothing allocated)."""
    from hybrid.models.gpt.model import GPT, GPTConfig

    return model_units(GPT(GPTConfig(**dict(shape)), device="meta"), tp, stage3_unit)


def _model_doc(spec) -> dict:
    from hybrid.config.yamlfile import load_yaml

    doc = load_yaml(spec.job.config, "model config")
    return doc if isinstance(doc, dict) else {}


def plan_links(lp, stage: int) -> dict:
    """The ``zero`` keys of the plan's link options (``LaunchPlan.links``) where ``stage`` can take them, else
    none (a re-plan to another stage runs its collectives flat)."""
    from hybrid.config.training import ZeroConfig
    from hybrid.errors import ConfigError

    links = getattr(lp, "links", None)
    keys = links.zero() if links is not None else {}
    try:
        ZeroConfig(stage=stage, **keys)
    except ConfigError:
        return {}
    return keys


def zero_config(lp, stage: int):
    """The ZeroConfig the ranks will build: the built-in GPT's ``zero:`` with the plan's link options
    (``plan_links``) unless it sets its own (``with_plan_links``), over the defaults."""
    return zero_config_of(lp.spec, lp.model, stage, plan_links(lp, stage))


def zero_config_of(spec, model: Optional[dict], stage: int, links: Optional[dict] = None):
    """``zero_config`` before the plan exists: for ``spec`` and its built-in GPT's shape (``model``, None for
    another model), with the link options ``links`` (``zero`` keys; None: the model config's alone). Stage 3
    takes every ``zero:`` option (``zero_options`` checks them there): a caller that reads only sizes asks for
    it."""
    from hybrid.config.training import ZeroConfig
    from hybrid.models.sections import with_plan_links, zero_options

    builtin = spec.job.entrypoint == "hybrid.models.gpt:train" or model is not None
    return ZeroConfig(stage=stage, **with_plan_links(links, zero_options(_model_doc(spec).get("zero"))
                                                     if builtin else {}))


def supports_activation_checkpointing(lp) -> bool:
    names = {f.name for f in dataclasses.fields(JobSettings)}
    return "activation_checkpointing" in names and lp.model is not None


def supports_offload(lp) -> bool:
    from hybrid.config.training import ZeroConfig

    names = {f.name for f in dataclasses.fields(ZeroConfig)}
    return device_of(lp) == "cuda" and any("offload" in n for n in names)


def predict(lp, choice: Choice) -> MemoryPrediction:
    """Predicted per-rank bytes of ``lp`` run with ``choice``."""
    precision, tp, dp = lp.spec.parallel.precision, lp.layout.tp, lp.layout.dp
    device, reserve = device_of(lp), runtime_reserve(lp)
    zero = zero_config(lp, choice.stage)
    units = units_of(lp, zero)
    # the plan's figures (the built-in GPT's formulas, another model's profile; 0 where neither: the ranks measure)
    activations = lp.activation_bytes(choice.micro_batch, choice.activation_checkpointing)
    p = predict_memory(units, dp, choice.stage, precision, activations=activations, runtime_reserve=reserve,
                       device=device, zero=zero, dp_per_node=max(1, lp.spec.cluster.gpus_per_node // tp))
    if choice.offload:  # master weights and moments live in host memory
        p = dataclasses.replace(p, optimizer=0, optimizer_transient=0)
    return p


def units_of(lp, zero) -> ModelUnits:
    """The trainable parameters of ``lp``'s model as one TP rank holds them, cut into ``zero``'s stage-3 units:
    the built-in GPT's shape, your own model built on meta, or a bare parameter count as one flat module."""
    tp = lp.layout.tp
    if lp.model is None and lp.module is not None:
        return model_units(lp.module, tp, zero.stage3_unit)
    if lp.model is None:
        return ModelUnits.from_lists([[-(-lp.params // tp)]])
    return _gpt_units(tuple(sorted(lp.model.items())), tp, zero.stage3_unit)


def ladder(lp, current: Choice) -> list[Choice]:
    """The candidates after ``current``, cheapest in throughput first (see the module docstring)."""
    out = [dataclasses.replace(current, stage=s) for s in range(current.stage + 1, 4)]
    top = dataclasses.replace(current, stage=3)
    if supports_activation_checkpointing(lp) and not top.activation_checkpointing:
        top = dataclasses.replace(top, activation_checkpointing=True)
        out.append(top)
    if supports_offload(lp) and not top.offload:
        top = dataclasses.replace(top, offload=True)
        out.append(top)
    while lp.model is not None and top.micro_batch % 2 == 0:
        top = dataclasses.replace(top, micro_batch=top.micro_batch // 2, accumulation=top.accumulation * 2)
        out.append(top)
    return out


def replan(lp, current: Choice, overshoot: Overshoot) -> tuple[Choice, MemoryPrediction]:
    """The first candidate on the ladder that fits the usable budget once corrected by the overshoot."""
    usable = usable_bytes(lp)
    for choice in by_time(lp, ladder(lp, current)):
        p = predict(lp, choice)
        if p.total + overshoot.extra <= usable:
            return choice, p
    raise NothingFits(nothing_fits(lp, current, overshoot))


def layout_of(lp, choice: Choice):
    """``choice`` on ``lp``'s mesh as a ``hybrid.plan.cost.Layout``."""
    from hybrid.plan.cost import Layout, LinkOptions

    c = lp.spec.cluster
    return Layout(c.nodes, c.gpus_per_node, lp.layout.tp, choice.stage, choice.micro_batch, choice.accumulation,
                  choice.activation_checkpointing, choice.offload, lp.spec.parallel.precision,
                  LinkOptions.from_zero(plan_links(lp, choice.stage)), nvme=choice.nvme)


def link_theory(lp, choice: Choice) -> tuple:
    """``(Ψ/t in bytes, {"intra": bytes, "inter": bytes, "total": bytes}, label)``: what ``hybrid.plan.links`` says
    ZeRO moves per GPU and step over each link for ``choice`` on ``lp``'s placement (Ψ/t as one unit) with the
    plan's link options (``plan_links``), and their label (``flat`` without any)."""
    from hybrid.plan.cost import DTYPE_BYTES
    from hybrid.plan.links import link_totals, step_traffic

    lay = layout_of(lp, choice)
    item = DTYPE_BYTES[lay.precision]
    local = lp.params / lay.tp
    traffic = (step_traffic([local], (), lay.policy, lay.topology(), item, item, lay.accumulation,
                            lay.links.quantization()) if lay.dp > 1 else {})
    return local * item, link_totals(traffic), lay.links.label or "flat"


def predicted_cost(lp, choice: Choice):
    """The time model's ``StepCost`` of ``lp`` run as ``choice``; None without a time model (another model
    than the built-in GPT)."""
    from hybrid.plan.cost import step_cost

    tm = getattr(lp, "time", None)
    if tm is None or tm.model is None:
        return None
    return step_cost(tm.model, layout_of(lp, choice), tm.hardware)


def by_time(lp, choices: list) -> list:
    """``choices`` fastest first by the time model (the ranking ``hybrid plan`` uses); choices within
    ``hybrid.plan.candidates.TIE`` of the fastest left keep their order (the ladder's: cheapest in memory
    traffic first). Without a time model, the order given."""
    from hybrid.plan.candidates import TIE

    costs = [predicted_cost(lp, c) for c in choices]
    if any(c is None for c in costs):
        return list(choices)
    left = list(zip(choices, (c.step_s for c in costs)))
    ordered = []
    while left:
        best = min(t for _, t in left)
        pick = next(i for i, (_, t) in enumerate(left) if t <= best * (1 + TIE))
        ordered.append(left.pop(pick)[0])
    return ordered


def nothing_fits(lp, current: Choice, overshoot: Overshoot) -> str:
    """One sentence: what would fit the last rung of the ladder -- the smallest node count, else the per-rank
    memory -- and, where they are still open, optimizer offload and a smaller micro-batch."""
    rungs = ladder(lp, current) or [current]
    last = rungs[-1]
    need = predict(lp, last).total + overshoot.extra
    cluster = lp.spec.cluster
    nodes = _nodes_that_fit(lp, last, overshoot.extra)
    memory_gb = need / (1 - lp.plan.headroom) / GB
    options = [f"at least {nodes} nodes (cluster.nodes, now {cluster.nodes})"] if nodes else []
    options.append(f"cluster.gpu_memory_gb >= {memory_gb:.3f}" if device_of(lp) == "cpu"
                   else f"GPUs of at least {memory_gb:.3f} GB")
    if device_of(lp) == "cuda" and not last.offload:
        options.append("optimizer offload")
    if last.micro_batch > 1:
        options.append("a smaller job.micro_batch")
    return (f"nothing fits {usable_bytes(lp) / GB:.3f} GB usable per rank: even {last.describe()} needs "
            f"{need / GB:.3f} GB (predicted {(need - overshoot.extra) / GB:.3f} GB plus the "
            f"{overshoot.extra / GB:.3f} GB measured beyond the prediction); it would fit with "
            f"{' or '.join(options)}")


def _nodes_that_fit(lp, choice: Choice, extra: float) -> Optional[int]:
    from hybrid.comm.mesh import MeshLayout

    cluster = lp.spec.cluster
    usable = usable_bytes(lp)
    for nodes in range(cluster.nodes + 1, MAX_NODES_SEARCHED + 1):
        layout = MeshLayout.of(nodes, cluster.gpus_per_node, lp.layout.tp)
        bigger = dataclasses.replace(lp, layout=layout)
        if predict(bigger, choice).total + extra <= usable:
            return nodes
        if nodes > 2 * cluster.nodes + 64:  # the per-rank figure stops shrinking long before this
            return None
    return None


def overshoot_of(record: dict, budget: float) -> Overshoot:
    """The largest measured peak of a run's ``memory.json`` against that run's prediction (``budget``: the
    rank's budget where the record has none). Raises ``NothingFits`` when the run measured nothing."""
    measured = record.get("measured") or {}
    if not measured:
        raise NothingFits("the run measured nothing (it stopped before its first step), so there is nothing to "
                          "re-plan from; run it for at least one step")
    rank, m = max(measured.items(), key=lambda kv: kv[1]["peak_bytes"])
    key = "peak" if m.get("device") == "cuda" else "total"
    return Overshoot(int(rank), float(max(m["peak_bytes"], m.get("nvml_used_bytes", 0))),
                     float(m.get("budget_bytes") or budget), float(record["predicted"][key]), int(m.get("step", 0)))


def from_measured(lp, record: dict) -> tuple[Choice, MemoryPrediction, Overshoot]:
    """Re-plan ``lp`` from a run's ``memory.json`` (``launch.planning.memory_loop``): the largest measured peak
    against that run's prediction gives the extra every candidate must hold; the candidates are stage 0
    to 3 at the job's micro-batch, then the rest of the ladder. ``record`` is as ``launch.planning.memory_loop.load``
    returns it, its figures checked there. Raises ``NothingFits``."""
    over = overshoot_of(record, budget_bytes(lp))
    start = Choice(0, lp.micro_batch or lp.spec.job.micro_batch, lp.accumulation)
    usable = usable_bytes(lp)
    for choice in by_time(lp, [start] + ladder(lp, start)):
        p = predict(lp, choice)
        if p.total + over.extra <= usable:
            return choice, p, over
    raise NothingFits(nothing_fits(lp, start, over))
