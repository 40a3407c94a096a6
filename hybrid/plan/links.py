"""Which link each ZeRO collective crosses, and the groups the options cut a DP group into (pure: plain numbers).

Two links: *intra* (inside a node: NVLink, or shared memory between the simulated nodes of one host) and
*inter* (between nodes: InfiniBand). Ranks run on nodes as the launcher placed them (``hybrid.comm.mesh``:
rank r of a job with g ranks per node on node r // g); a DP group of N ranks then has k = N / m of its ranks on
each of its m nodes (k > 1 where tp < gpus per node).

**Bytes per link.** Every collective is counted as ``hybrid.comm`` counts it (the ZeRO paper's logical bytes:
all-gather and reduce-scatter ``|X|``, all-reduce ``2|X|``, all-to-all its input), and those bytes are split by
what a ring over its group sends across node boundaries (``split``): the ring visits each node's ranks in a row,
so of its n hops one per node leaves the node -- ``nodes / n`` of the bytes per rank (averaged over the group's
ranks) cross, none on a group inside one node, all on a group of one rank per node. So a flat collective over a
DP group of k ranks per node sends ``|X|/k`` per rank across nodes, the node's NICs ``|X|`` per DP ring.

**The groups** (``ShardTopology``; the engine creates them, the memory model and the planner price them):

* ``shard_group`` s (``all``: N; ``node``: k; or a number dividing N): parameters, gradients and optimizer
  states are sharded over s consecutive DP ranks and replicated across the N/s such groups (MiCS, FSDP2's HSDP);
  a gradient is reduce-scattered inside the shard group, then its shard all-reduced across the replicas
  (``replica_groups``: the ranks at the same position of every shard group) once per optimizer step.
* ``hierarchical``: a shard group spanning m_s nodes with k_s ranks on each reduce-scatters in two levels --
  inside the node over the full ``|X|`` (``intra_groups``), then across nodes over the node's ``|X|/k_s``
  (``inter_groups``: the ranks with the same local index) -- and all-gathers in the reverse order. The rank
  at local index l on the shard group's n-th node then owns shard ``position = l·m_s + n``: the intra step's
  part l holds exactly the shards of the l-th ranks of every node, so neither level permutes any data.
* ``secondary_shard`` h (hpZ): at stage 3 each rank also keeps 1/h of every gathered unit, h ranks of one
  node together holding it whole (``secondary_groups``), so backward's all-gather never leaves the node.

``step_collectives`` lists the collectives of an optimizer step under these options, each with its bytes, its
group's span and when it runs (what ``hybrid.plan.cost`` prices), ``step_traffic`` their bytes per link (what
``tests/dist/test_zero_links.py`` checks the engine's counters against). Quantized collectives
(``quantized_bytes``) move int8 values plus one fp32 scale per block of ``block`` elements, per chunk of the
collective.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction
from typing import Optional, Sequence, Union

from hybrid.config.stage_policy import StagePolicy
from hybrid.errors import ConfigError

INTRA, INTER = "intra", "inter"
SCALE_BYTES = 4  # one fp32 scale per quantization block


# ------------------------------------------------------------------------------------------- one collective
def inter_fraction(nodes: int, size: int) -> Fraction:
    """The share of a collective's bytes that cross node boundaries, per rank, for a ring over ``size`` ranks on
    ``nodes`` nodes (each node's ranks adjacent on the ring): ``nodes / size``, or none inside one node."""
    if size <= 1 or nodes <= 1:
        return Fraction(0)
    return Fraction(nodes, size)


def split(nbytes: Union[int, float, Fraction], nodes: int, size: int) -> tuple:
    """``(intra, inter)`` bytes of a collective counted ``nbytes`` over ``size`` ranks on ``nodes`` nodes (a group
    of one moves, and counts, nothing)."""
    if size <= 1:
        return Fraction(0), Fraction(0)
    inter = Fraction(nbytes) * inter_fraction(nodes, size)
    return Fraction(nbytes) - inter, inter


def quantized_bytes(numel, block: int):
    """Bytes of ``numel`` values quantized to int8 in blocks of ``block`` elements: one byte each plus one fp32
    scale per block (the last block may be shorter)."""
    return numel + SCALE_BYTES * math.ceil(numel / block)


# ---------------------------------------------------------------------------------------------- the groups
ShardSize = Union[str, int]  # "all" | "node" | a number of ranks


@dataclass(frozen=True)
class Span:
    """A group as the link accounting sees it: its size and how many nodes it spans."""

    size: int
    nodes: int

    def split(self, nbytes) -> tuple:
        return split(nbytes, self.nodes, self.size)


@dataclass(frozen=True)
class ShardTopology:
    """How a DP group of ranks on ``nodes`` (the node of each DP rank, in DP rank order) is cut by the options.

    Groups are lists of DP ranks (indices into ``nodes``); ``position(r)`` is the shard DP rank r owns. Build it
    with ``ShardTopology.of``, which checks the options against the placement (one sentence each)."""

    nodes: tuple
    shard: int          # s: ranks a unit is sharded over
    hierarchical: bool  # two-level reduce-scatter and all-gather inside each shard group
    secondary: int      # h: hpZ's secondary group size (1: none)

    # -- construction ------------------------------------------------------------------------------------
    @classmethod
    def of(cls, nodes: Sequence[int], shard: ShardSize = "all", hierarchical: bool = False,
           secondary: ShardSize = "none", where: str = "zero") -> "ShardTopology":
        nodes = tuple(int(n) for n in nodes)
        n = len(nodes)
        if n < 1:
            raise ValueError("a DP group has at least one rank")
        per_node = _ranks_per_node(nodes)
        s = _shard_size(shard, n, per_node, f"{where}.shard_group")
        topo = cls(nodes, s, False, 1)
        if hierarchical:
            _check_hierarchical(topo, f"{where}.hierarchical")
            topo = cls(nodes, s, True, 1)
        h = _secondary_size(secondary, topo, f"{where}.secondary_shard")
        return cls(nodes, s, topo.hierarchical, h)

    @classmethod
    def flat(cls, size: int, ranks_per_node: Optional[int] = None) -> "ShardTopology":
        """A DP group of ``size`` ranks, ``ranks_per_node`` of them on each node (default: one node), sharded
        over all of them with no option on."""
        per = size if ranks_per_node is None else ranks_per_node
        return cls(tuple(r // per for r in range(size)), size, False, 1)

    # -- sizes ---------------------------------------------------------------------------------------------
    @property
    def size(self) -> int:
        return len(self.nodes)

    @property
    def replicas(self) -> int:
        return self.size // self.shard

    def shard_groups(self) -> list:
        s = self.shard
        return [list(range(g * s, (g + 1) * s)) for g in range(self.replicas)]

    def replica_groups(self) -> list:
        """The ranks at the same position of every shard group (one all-reduce group per position)."""
        if self.replicas <= 1:
            return []
        by_position: dict = {}
        for group in self.shard_groups():
            for r, p in self._positions(group).items():
                by_position.setdefault(p, []).append(r)
        return [by_position[p] for p in sorted(by_position)]

    def _blocks(self, group: list) -> list:
        """``group``'s ranks by node, in order."""
        out: dict = {}
        for r in group:
            out.setdefault(self.nodes[r], []).append(r)
        return list(out.values())

    def intra_groups(self) -> list:
        """Hierarchical: each shard group's ranks on one node (the first level)."""
        return [b for g in self.shard_groups() for b in self._blocks(g)] if self.hierarchical else []

    def inter_groups(self) -> list:
        """Hierarchical: each shard group's ranks with the same local index, one per node (the second level)."""
        if not self.hierarchical:
            return []
        return [list(ranks) for g in self.shard_groups() for ranks in zip(*self._blocks(g))]

    def secondary_groups(self) -> list:
        """hpZ: ``secondary`` consecutive ranks of one node inside each shard group."""
        if self.secondary <= 1:
            return []
        h = self.secondary
        return [b[i:i + h] for g in self.shard_groups() for b in self._blocks(g) for i in range(0, len(b), h)]

    def position(self, r: int) -> int:
        """The shard DP rank ``r`` owns in its shard group."""
        g = r // self.shard
        return self._positions(list(range(g * self.shard, (g + 1) * self.shard)))[r]

    def _positions(self, group: list) -> dict:
        """Rank -> the shard it owns, for the ranks of one shard group: its index in the group; hierarchical,
        the node-major order of the two-level collectives (local index x nodes + node)."""
        if not self.hierarchical:
            return {r: i for i, r in enumerate(group)}
        blocks = self._blocks(group)
        return {r: i * len(blocks) + n for n, block in enumerate(blocks) for i, r in enumerate(block)}

    def group_of(self, groups: list, r: int) -> list:
        return next(g for g in groups if r in g)

    # -- spans (what the link accounting needs) -----------------------------------------------------------
    def span(self, group: list) -> Span:
        return Span(len(group), len({self.nodes[r] for r in group}))

    def spans(self, r: int = 0) -> "Spans":
        """The spans of DP rank ``r``'s groups (a group of one where it has none)."""
        def of(groups: list) -> Span:
            mine = next((g for g in groups if r in g), None)
            return self.span(mine) if mine is not None else Span(1, 1)
        return Spans(dp=self.span(list(range(self.size))), shard=of(self.shard_groups()),
                     replica=of(self.replica_groups()), intra=of(self.intra_groups()),
                     inter=of(self.inter_groups()), secondary=of(self.secondary_groups()))


    def describe(self) -> str:
        parts = [f"shard over {self.shard} of {self.size} DP ranks"]
        if self.replicas > 1:
            parts.append(f"{self.replicas} replicas")
        if self.hierarchical:
            spans = self.spans()
            parts.append(f"hierarchical ({spans.intra.size} in a node x {spans.inter.size} nodes)")
        if self.secondary > 1:
            parts.append(f"hpZ secondary shard over {self.secondary}")
        return ", ".join(parts)


@dataclass(frozen=True)
class Spans:
    """The groups one rank's collectives run on, as the link accounting sees them."""

    dp: Span
    shard: Span
    replica: Span
    intra: Span
    inter: Span
    secondary: Span


def _ranks_per_node(nodes: tuple) -> Optional[int]:
    """The DP ranks on each node when every node holds as many, each node's ranks consecutive; else None."""
    runs, last = [], None
    for n in nodes:
        if n != last:
            runs.append(0)
            last = n
        runs[-1] += 1
    if len(runs) != len(set(nodes)) or len(set(runs)) != 1:
        return None
    return runs[0]


def _shard_size(shard: ShardSize, n: int, per_node: Optional[int], path: str) -> int:
    if shard == "all":
        return n
    if shard == "node":
        if per_node is None:
            raise ConfigError(f"{path} is node but the DP ranks are spread unevenly over the nodes; give the shard "
                              f"group as a number of ranks dividing the DP size {n}, or all.")
        if per_node == 1 and n > 1:
            raise ConfigError(f"{path} is node but there is one DP rank per node here, so nothing would be sharded "
                              f"(every rank would hold all the states); use all, or lower tp so DP ranks share a "
                              f"node.")
        return per_node
    s = int(shard)
    if n % s:
        raise ConfigError(f"{path} is {s} ranks but that does not divide the DP size {n}; choose a divisor of "
                          f"{n} (node, all, or a number such as {_divisors_hint(n)}).")
    return s


def _divisors_hint(n: int) -> str:
    return " or ".join(str(d) for d in range(1, n + 1) if n % d == 0 and 1 < d < n) or str(n)


def _check_hierarchical(topo: ShardTopology, path: str) -> None:
    group = topo.shard_groups()[0]
    blocks = [topo._blocks(g) for g in topo.shard_groups()]
    sizes = {len(b) for bs in blocks for b in bs}
    if len(sizes) != 1 or any(sorted(sum(bs, [])) != sum(bs, []) for bs in blocks):
        raise ConfigError(f"{path} needs the same number of DP ranks on every node of a shard group, but they are "
                          f"spread unevenly; set {path}: false.")
    k, m = sizes.pop(), len(blocks[0])
    if m == 1 or k == 1:
        where = ("inside one node" if m == 1 else "one DP rank per node")
        raise ConfigError(f"{path} splits collectives into a step inside each node and one across nodes, but the "
                          f"shard group of {len(group)} DP ranks is {where}, so there is nothing to split; set "
                          f"{path}: false.")


def _secondary_size(secondary: ShardSize, topo: ShardTopology, path: str) -> int:
    if secondary in ("none", None, 1):
        return 1
    blocks = topo._blocks(topo.shard_groups()[0])
    k = len(blocks[0]) if len({len(b) for b in blocks}) == 1 else None
    if k == 1:
        raise ConfigError(f"{path} keeps a secondary parameter shard among the DP ranks of one node (hpZ), but "
                          f"there is one DP rank per node here; remove {path} (or lower tp so DP ranks share "
                          f"a node).")
    if len(blocks) == 1:
        raise ConfigError(f"{path} saves backward's all-gather across nodes, but the shard group of {topo.shard} "
                          f"DP ranks is inside one node, so that all-gather never leaves it; remove {path}.")
    if k is None:
        raise ConfigError(f"{path} needs the same number of DP ranks on every node of a shard group, but they are "
                          f"spread unevenly; remove {path}.")
    h = k if secondary == "node" else int(secondary)
    if h < 1 or k % h:
        raise ConfigError(f"{path} is {h} ranks but a shard group has {k} DP ranks per node, which it must divide; "
                          f"use node ({k}) or a divisor of {k}.")
    return h


# ------------------------------------------------------------------------------------ the step's traffic
@dataclass(frozen=True)
class Quantization:
    """Which collectives move int8 blocks (``block`` elements per fp32 scale)."""

    weights: bool = False
    gradients: bool = False
    block: int = 256


@dataclass(frozen=True)
class Collective:
    """``calls`` collectives of kind ``op``, each counted ``nbytes`` per rank (``hybrid.comm``'s logical bytes),
    over a group of ``span``, in ``phase``: ``forward`` (stage 3's gathers before each unit's forward),
    ``backward`` (the gradient reduction, and stage 3's gathers before each unit's backward), ``boundary`` (once
    per step, during the last micro-step's backward: the replicas' all-reduce) or ``after`` (the step's
    all-gather)."""

    op: str
    nbytes: float
    span: Span
    phase: str
    calls: float = 1.0

    @property
    def ring_bytes(self) -> float:
        """What each rank sends: (n-1)/n of the counted bytes (a ring, or an all-to-all, over n ranks)."""
        n = self.span.size
        return self.calls * float(self.nbytes) * (n - 1) / n if n > 1 else 0.0

    def split(self) -> tuple:
        """``(intra, inter)`` of all its calls (``split``)."""
        intra, inter = self.span.split(self.nbytes)
        return self.calls * intra, self.calls * inter


def _gather(unit, item, topo: ShardTopology, spans: Spans, quantized: bool, block: int, phase: str,
            calls: float) -> list:
    """The collectives of ``calls`` all-gathers of a unit of ``unit`` elements from its shards."""
    chunk = unit / topo.shard
    if not topo.hierarchical:
        nbytes = topo.shard * quantized_bytes(chunk, block) if quantized else unit * item
        return [Collective("all_gather", nbytes, spans.shard, phase, calls)]
    across, inside = spans.inter, spans.intra
    nbytes = across.size * quantized_bytes(chunk, block) if quantized else unit / inside.size * item
    return [Collective("all_gather", nbytes, across, phase, calls),
            Collective("all_gather", unit * item, inside, phase, calls)]


def _reduce(unit, grad_item, topo: ShardTopology, spans: Spans, quantized: bool, block: int, calls: float) -> list:
    """The collectives of ``calls`` reduce-scatters of a unit's gradients to their shards (quantized: an
    all-to-all of int8 blocks; hierarchical: only the level across nodes)."""
    chunk = unit / topo.shard
    if not topo.hierarchical:
        if quantized:
            return [Collective("all_to_all", topo.shard * quantized_bytes(chunk, block), spans.shard, "backward",
                               calls)]
        return [Collective("reduce_scatter", unit * grad_item, spans.shard, "backward", calls)]
    across, inside = spans.inter, spans.intra
    second = (Collective("all_to_all", across.size * quantized_bytes(chunk, block), across, "backward", calls)
              if quantized else Collective("reduce_scatter", unit / inside.size * grad_item, across, "backward", calls))
    return [Collective("reduce_scatter", unit * grad_item, inside, "backward", calls), second]


def step_collectives(units: Sequence, persistent: Sequence[int], policy: StagePolicy, topo: ShardTopology,
                     item: int, grad_item: int, accumulation: int = 1, quant: Quantization = Quantization(),
                     reduce_scatter: bool = True, rank: int = 0) -> list:
    """The collectives DP rank ``rank`` issues in one optimizer step of ``accumulation`` micro-steps, for units of
    ``units`` padded elements (``persistent``: the indices gathered only after the step), as the engine issues
    them (``hybrid.zero``): stage 0 all-reduces each unit over DP once; stages 1-2 reduce-scatter each unit (at
    every micro-step where gradients are sharded) and all-gather it after the step; stage 3 gathers every unit
    but the persistent ones before its forward and its backward (hpZ: backward's inside the secondary group) at
    every micro-step, reduce-scatters every unit, and gathers the persistent units after the step. With
    replicas, each unit's gradient shard is all-reduced across them once per step. Leaves out the gradient
    norm's and the unit check's few bytes."""
    spans = topo.spans(rank)
    if policy.grads_all_reduced:
        return [Collective("all_reduce", 2 * u * grad_item, spans.dp, "backward") for u in units]
    out = []
    reductions = accumulation if policy.shard_grads else 1
    for u in units:
        if reduce_scatter:
            out += _reduce(u, grad_item, topo, spans, quant.gradients, quant.block, reductions)
        else:
            out.append(Collective("all_reduce", 2 * u * grad_item, spans.shard, "backward", reductions))
        if topo.replicas > 1:
            out.append(Collective("all_reduce", 2 * u / topo.shard * grad_item, spans.replica, "boundary"))
    skip = set(persistent)
    for i, u in enumerate(units):
        if not policy.shard_params or i in skip:
            continue
        out += _gather(u, item, topo, spans, quant.weights, quant.block, "forward", accumulation)
        if topo.secondary > 1:
            out.append(Collective("all_gather", u * item, spans.secondary, "backward", accumulation))
        else:
            out += _gather(u, item, topo, spans, quant.weights, quant.block, "backward", accumulation)
    refreshed = (range(len(units)) if policy.refresh == "all" else
                 sorted(skip) if policy.refresh == "persistent" else [])
    for i in refreshed:
        out += _gather(units[i], item, topo, spans, False, quant.block, "after", 1)
    return out


def step_traffic(units: Sequence, persistent: Sequence[int], policy: StagePolicy, topo: ShardTopology,
                 item: int, grad_item: int, accumulation: int = 1, quant: Quantization = Quantization(),
                 reduce_scatter: bool = True, rank: int = 0) -> dict:
    """op -> (intra, inter) bytes of ``step_collectives``: what ``engine.comm_report()`` counts in one step."""
    out: dict = {}
    for c in step_collectives(units, persistent, policy, topo, item, grad_item, accumulation, quant, reduce_scatter,
                              rank):
        intra, inter = c.split()
        a, b = out.get(c.op, (0.0, 0.0))
        out[c.op] = (a + float(intra), b + float(inter))
    return out


def link_totals(traffic: dict) -> dict:
    """``{"intra": bytes, "inter": bytes, "total": bytes}`` of a ``step_traffic`` result."""
    intra = sum(a for a, _ in traffic.values())
    inter = sum(b for _, b in traffic.values())
    return {INTRA: intra, INTER: inter, "total": intra + inter}
