"""The time-aware choice: every layout the job could run, those that fit memory, ranked by predicted tokens/s.

``layouts(...)`` lists the candidates: each TP degree offered, ZeRO stage, activation checkpointing and
offload setting (False, True: host memory, ``"nvme"``: the node's disk), and each split of a DP rank's rows
into micro-batch × accumulation that keeps the global batch (``global_batch`` sequences per step in every
candidate; a TP degree whose DP degree does not divide it is left out), each with every way its ZeRO
collectives may use the links (``LINK_CHOICES``: flat, the shard group of a node, two-level collectives, hpZ,
int8; those the stage or the placement cannot take are left out, ``link_options``). A user's fixed choices
are the only values offered for their field; offload is never paired with stage 0 (nothing sharded to move).

``rank(model, layouts, hw, memory)`` costs each (``hybrid.plan.cost.step_cost``) and sizes it
(``memory(layout) -> hybrid.plan.planner.Option``, the planner's own rule); only layouts that fit are ever
chosen: the fastest by tokens/s; where others are within ``TIE`` of it (the same speed, as far as the model
can tell), the memory-only choice (``baseline``) when it is one of them -- the guide's choice stands unless
time says otherwise -- else the one with the fewest levers (no offload, not NVMe, then no activation
checkpointing, then the fewest link options) and then the least memory per GPU. Candidates with int8
collectives are priced but never chosen (``Ranking.lossy``): they change the values every step computes with,
so they are the user's choice (``zero.quantized_weights`` / ``quantized_gradients``); ``hybrid plan`` shows
what they would save. The ``Ranking`` carries every other candidate, fitting ones first, fastest first, and
one reason sentence that names the numbers: what the choice does differently from the memory-only choice
(``baseline``), or, where they agree, from the runner-up.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Optional, Sequence

from hybrid.config.stage_policy import policy_for
from hybrid.config.units import human_bytes
from hybrid.errors import ConfigError
from hybrid.plan.cost import DEFAULT_BUCKET_NUMEL, FLAT, Hardware, Layout, LinkOptions, ModelShape, StepCost, step_cost

TIE = 0.01  # tokens/s within 1% of the fastest: the same speed, within what the model can tell apart
TOP = 8     # candidates a plan shows
# How ZeRO's collectives may use the links: flat; sharded inside a node, replicated across (HSDP); two-level;
# two-level with hpZ's secondary shard; and that with int8 weights and gradients (ZeRO++).
LINK_CHOICES = (
    FLAT,
    LinkOptions(shard_group="node"),
    LinkOptions(hierarchical=True),
    LinkOptions(hierarchical=True, secondary_shard="node"),
    LinkOptions(hierarchical=True, secondary_shard="node", quantized_weights=True, quantized_gradients=True),
)


def link_options(lay: Layout, choices=LINK_CHOICES) -> list:
    """The ``choices`` the layout's stage and placement can take (``ZeroConfig``'s and ``ShardTopology``'s own
    rules), flat always among them; of choices that cut the DP group alike (on one node, the shard group of a
    node is all of it) only the first."""
    from hybrid.config.training import ZeroConfig

    out, seen = [], set()
    for links in (FLAT, *choices):
        try:
            ZeroConfig(stage=lay.stage, **links.zero())
            topology = Layout(**{**lay.__dict__, "links": links}).topology()
        except ConfigError:
            continue
        key = (topology, links.quantized_weights, links.quantized_gradients)
        if key not in seen:
            seen.add(key)
            out.append(links)
    return out


@dataclass(frozen=True)
class Candidate:
    option: object  # hybrid.plan.planner.Option: bytes per GPU (and host) and whether it fits
    cost: StepCost

    @property
    def layout(self) -> Layout:
        return self.cost.layout

    @property
    def fits(self) -> bool:
        return bool(self.option.fits)

    @property
    def device_bytes(self) -> float:
        return float(self.option.device_bytes)

    def as_dict(self) -> dict:
        lay = self.layout
        return {"tp": lay.tp, "dp": lay.dp, "stage": lay.stage, "micro_batch": lay.micro_batch,
                "accumulation": lay.accumulation, "activation_checkpointing": lay.activation_checkpointing,
                "offload": lay.offload, "nvme": lay.nvme, "links": lay.links.zero(),
                "device_bytes": self.device_bytes, "host_bytes": float(self.option.host_bytes),
                "disk_bytes": float(getattr(self.option, "disk_bytes", 0.0)), "fits": self.fits,
                **self.cost.as_dict()}


@dataclass(frozen=True)
class Ranking:
    candidates: tuple       # fitting first (fastest first), then the rest (fastest first)
    chosen: Optional[Candidate]  # None: nothing fits
    baseline: Optional[Candidate]  # the memory-only choice, where it is among the candidates
    global_batch: int
    reason: str
    lossy: tuple = ()       # the int8 candidates: priced, never chosen (see the module docstring)

    @property
    def fitting(self) -> list:
        return [c for c in self.candidates if c.fits]

    def top(self, n: int = TOP) -> list:
        """The ``n`` fastest that fit, with the chosen one and the baseline always among them."""
        shown = self.fitting[:n]
        for extra in (self.chosen, self.baseline):
            if extra is not None and extra not in shown:
                shown.append(extra)
        return shown


def batch_splits(global_batch: int, dp: int, micro_batch: Optional[int] = None) -> list[tuple[int, int]]:
    """``(micro_batch, accumulation)`` pairs that train ``global_batch`` sequences per step on ``dp`` DP
    ranks: every divisor of the rows per rank, or only ``micro_batch`` when it is fixed; none when the
    rows do not split."""
    if global_batch % dp:
        return []
    rows = global_batch // dp
    if micro_batch is not None:
        return [(micro_batch, rows // micro_batch)] if rows % micro_batch == 0 else []
    return [(b, rows // b) for b in range(1, rows + 1) if rows % b == 0]


def layouts(nodes: int, gpus_per_node: int, precision: str, tps: Iterable[int], stages: Iterable[int],
            checkpointing: Iterable[bool], offloads: Iterable[bool], global_batch: int,
            micro_batch: Optional[int] = None, links=(FLAT,)) -> list[Layout]:
    """Every candidate layout (see the module docstring); ``links``: the link options to weigh
    (``LINK_CHOICES`` for all of them), each where the layout can take it."""
    out = []
    for tp in tps:
        dp = nodes * gpus_per_node // tp
        for b, k in batch_splits(global_batch, dp, micro_batch):
            for s in stages:
                for ac in checkpointing:
                    for off in offloads:
                        if off and not policy_for(s).shard_optimizer:  # nothing sharded to move
                            continue
                        lay = Layout(nodes, gpus_per_node, tp, s, b, k, ac, bool(off), precision,
                                     nvme=off == "nvme")
                        out += [Layout(**{**lay.__dict__, "links": lk}) for lk in link_options(lay, links)]
    return out


def rank(model: ModelShape, candidates: Sequence[Layout], hw: Hardware, memory: Callable[[Layout], object],
         baseline: Optional[Layout] = None, bucket_numel: int = DEFAULT_BUCKET_NUMEL) -> Ranking:
    """Cost and size every layout and choose (see the module docstring)."""
    costed = [Candidate(memory(lay), step_cost(model, lay, hw, bucket_numel)) for lay in candidates]
    lossy = tuple(sorted((c for c in costed if _lossy(c.layout)), key=lambda c: -c.cost.tokens_per_s))
    costed = [c for c in costed if not _lossy(c.layout)]
    by_speed = sorted(costed, key=lambda c: -c.cost.tokens_per_s)
    ordered = tuple([c for c in by_speed if c.fits] + [c for c in by_speed if not c.fits])
    fitting = [c for c in ordered if c.fits]
    base = next((c for c in costed if c.layout == baseline), None)
    global_batch = candidates[0].global_batch if candidates else 0
    if not fitting:
        return Ranking(ordered, None, base, global_batch, "no layout fits the memory", lossy)
    fastest = fitting[0].cost.tokens_per_s
    ties = [c for c in fitting if c.cost.tokens_per_s >= fastest * (1 - TIE)]
    if base is not None and base in ties:
        chosen = base
    else:
        chosen = min(ties, key=lambda c: (c.layout.offload, c.layout.nvme, c.layout.activation_checkpointing,
                                          _link_levers(c.layout), c.device_bytes, ties.index(c)))
    return Ranking(ordered, chosen, base, global_batch, reason(chosen, base, fitting), lossy)


def _lossy(lay: Layout) -> bool:
    return lay.links.quantized_weights or lay.links.quantized_gradients


def _link_levers(lay: Layout) -> int:
    return len(lay.links.zero())


# ------------------------------------------------------------------------------------------------ why


def reason(chosen: Candidate, baseline: Optional[Candidate], fitting: list) -> str:
    """One sentence naming the numbers: the choice against the memory-only one, or, where they are the same
    layout, against the fastest other one."""
    c = chosen.cost
    rest = [x for x in fitting if x.layout != chosen.layout]
    if baseline is not None and baseline.layout != chosen.layout:
        other, against = baseline, "the memory-only choice"
    elif not rest:
        return f"{describe(chosen.layout)}: the only layout that fits, {_rate(c)} ({_ms(c.step_s)} per step)"
    else:
        other = rest[0]
        if other.cost.tokens_per_s >= c.tokens_per_s:  # kept within the tie: the guide's or the leaner one
            why = ("the memory-only choice, kept" if baseline is not None else "the fewest levers and least memory")
            return (f"{describe(chosen.layout)}: {why}: {describe(other.layout)} predicts "
                    f"{other.cost.tokens_per_s / c.tokens_per_s:.3f}x its {_rate(c)}, within the {TIE:.0%} the "
                    f"model cannot tell apart; it differs by {differences(other, chosen)}")
        against = "the memory-only choice, also the fastest; next" if baseline is not None else "the runner-up"
    ratio = c.tokens_per_s / other.cost.tokens_per_s
    return (f"{describe(chosen.layout)} over {against} ({describe(other.layout)}): {differences(chosen, other)}: "
            f"step {_ms(other.cost.step_s)} -> {_ms(c.step_s)}, {ratio:.2f}x tokens/s ({_rate(c)})")


def differences(a: Candidate, b: Candidate) -> str:
    """What ``a`` does differently from ``b``, with the numbers that make the difference."""
    la, lb, ca, cb = a.layout, b.layout, a.cost, b.cost
    parts = []
    if la.tp != lb.tp:
        parts.append(f"tp {lb.tp} -> {la.tp}: TP traffic {_ms(cb.tp_s)} -> {_ms(ca.tp_s)}, compute "
                     f"{_ms(cb.compute_s)} -> {_ms(ca.compute_s)}")
    if la.stage != lb.stage:
        traffic = ca.dp_bytes / cb.dp_bytes if cb.dp_bytes and la.tp == lb.tp else None
        what = ("same traffic" if traffic is not None and abs(traffic - 1) < 0.01 else
                f"{traffic:.2g}x the traffic" if traffic else "DP traffic")
        parts.append(f"stage {lb.stage} -> {la.stage}: {what} {_ms(cb.dp_s)} -> {_ms(ca.dp_s)}, exposed "
                     f"{_ms(cb.exposed_s)} -> {_ms(ca.exposed_s)}")
    if la.micro_batch != lb.micro_batch:
        freed = b.device_bytes - a.device_bytes
        room = f"the freed {human_bytes(freed)} takes" if freed > 0 and la.micro_batch > lb.micro_batch else "with"
        parts.append(f"{room} micro-batch {la.micro_batch} x {la.accumulation} instead of {lb.micro_batch} x "
                     f"{lb.accumulation} (per-micro-step cost {_ms(cb.micro_s)} -> {_ms(ca.micro_s)})")
    if la.activation_checkpointing != lb.activation_checkpointing:
        recompute = ca.recompute_s if la.activation_checkpointing else cb.recompute_s
        parts.append(("with" if la.activation_checkpointing else "without") +
                     f" activation checkpointing ({_ms(recompute)} of recompute)")
    if (la.offload, la.nvme) != (lb.offload, lb.nvme):
        on, c = (la, ca) if la.offload else (lb, cb)
        what = (f"NVMe optimizer offload ({_ms(c.offload_s)} of PCIe, host and disk)" if on.nvme else
                f"optimizer offload ({_ms(c.offload_s)} of PCIe and host)")
        if la.offload and lb.offload:
            parts.append(f"with {what} instead of " + ("host memory" if la.nvme else "NVMe"))
        else:
            parts.append(("with " if la.offload else "without ") + what)
    if la.links != lb.links:
        parts.append(f"ZeRO collectives {lb.links.label or 'flat'} -> {la.links.label or 'flat'}: across nodes "
                     f"{human_bytes(cb.terms['dp_inter_bytes'])} -> {human_bytes(ca.terms['dp_inter_bytes'])} per GPU "
                     f"and step, DP {_ms(cb.dp_s)} -> {_ms(ca.dp_s)}")
    return ", ".join(parts) or "the same layout"


def describe(lay: Layout) -> str:
    levers = [text for on, text in ((lay.activation_checkpointing, "AC"),
                                    (lay.offload, "NVMe offload" if lay.nvme else "offload"),
                                    (bool(lay.links.label), lay.links.label)) if on]
    acc = f" x {lay.accumulation}" if lay.accumulation > 1 else ""
    return f"tp {lay.tp}, stage {lay.stage}, micro-batch {lay.micro_batch}{acc}" + \
        (f", {' + '.join(levers)}" if levers else "")


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3g} ms" if seconds < 1 else f"{seconds:.3g} s"


def _rate(c: StepCost) -> str:
    return f"{c.tokens_per_s:,.0f} tokens/s"
