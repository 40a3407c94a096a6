"""The time model: what one training step of a layout costs per GPU, term by term (pure, no torch, no Ray).

``step_cost(model, layout, hw)`` returns a ``StepCost`` whose terms are, per GPU and per optimizer step
(k = gradient accumulation steps, b = micro-batch, s = sequence length, h = hidden size, L = layers,
t = TP degree, N = DP degree, Ψ = parameters):

* **compute**: ``6·Ψ_mm·T/t`` plus attention ``12·L·h·s·T/t`` for the T = b·k·s tokens of a DP rank's step,
  at ``peak · efficiency``; Ψ_mm leaves out the token and position embeddings (a lookup does no FLOPs).
  Activation checkpointing recomputes each block's forward in backward: ``2·Ψ_blocks·T/t + 4·L·h·s·T/t``
  more. A shape from a model's measured profile (``ModelShape.from_profile``) has its FLOPs per token instead,
  ``(A + B·s)·T/t`` (``flop_terms``), and the recompute's likewise (``recompute_terms``). Forward is a third of
  the model FLOPs, backward the rest and the recompute.
* **TP**: Megatron's activation all-reduces of b·s·h elements: two per block in forward, two in backward
  (two more in the recomputed forward), one each for the vocab-parallel embedding and LM head, and three
  small ones of the vocab-parallel loss; ring bytes ``2(t-1)/t`` of the message per call, on the intra-node
  link, k times per step, never hidden (every one is on the critical path).
* **DP (ZeRO)**: what the stage's policy (``hybrid.config.stage_policy``) moves, with the ring factor
  ``(N-1)/N``: its gradient reduction (``all_reduce``: 2Ψ/t, a reduce-scatter: Ψ/t elements) once per step
  or, where gradients are sharded, at every micro-step; where parameters are sharded, an all-gather of
  Ψ/t before each unit's forward and again before its backward, at every micro-step; after the step the
  all-gather its ``refresh`` names (``all``: Ψ/t). Stages 0-2 move 2Ψ/t, stage 3 3Ψ/t per micro-step.
  The collectives are ``hybrid.plan.links.step_collectives`` for the layout's ``links`` options (shard
  groups, two-level collectives, hpZ, int8; ``LinkOptions``), each priced on its group: a group inside one
  node on the rank's own link; a ring across nodes on the node's NICs (``Hardware.inter`` is the node's
  bandwidth), which carry one crossing per ring of the node's ranks on it -- ``ring bytes x gpus_per_node x
  nodes / ranks`` -- while its hops inside a node run at the same time (the slower of the two). The two
  levels of a hierarchical collective run one after the other. Quantization's own kernels (packing,
  unpacking: elementwise, memory bound) are not priced.
* **overlap**: the gradient reduction runs bucketed in backward, the stage-3 gathers are prefetched in
  forward and backward; ``hw.overlap`` of what fits under that compute is hidden. Stages whose reduction
  waits for the last micro-step hide it only under that micro-step's backward; the after-step gather is
  never hidden.
* **offload**: the gradient shard to the host and the updated parameter shard back over PCIe, and the host
  optimizer stepping the shard at the host's Adam rate (shared by the node's ranks); the gradient copy
  hides under backward like the reduction. With the states on NVMe (``Layout.nvme``) the step also reads
  and writes the rank's swap file once, 12 B per parameter of the shard each way, on the node's disk
  (``Hardware.nvme``, shared by the node's ranks; the read and the write take turns on it); the swap store
  pipelines them with the host's step, so the slower of the two counts: ``max(host step, disk)``.
* **optimizer**: the device optimizer over the rank's shard (all of Ψ/t where the optimizer is not
  sharded) at the device's Adam rate (memory bound).
* **per micro-step**: what a micro-step costs whatever its size, k times per step: the host's dispatch of its
  eager ops (``ModelShape.ops_per_micro_step``: the forward, backward and recompute ops at ``hw.op_overhead``
  each; a profile's own count where the shape has one, with the engine's hooks and the TP collectives' ops) and
  its passes over the parameters (``PARAM_PASSES``: Ψ/t read in forward and in backward, the
  gradients written and accumulated, one more read with activation checkpointing) at
  ``hw.memory_bandwidth``. This is why twice the micro-steps of half the size are slower for the same tokens.
  A GPU runs it beside its kernels (the host queues work ahead while the device computes or waits on a
  collective; weights stream under the matmuls): ``hw.overlap`` of what fits under the device's time is
  hidden; a CPU rank does it on the cores that compute (``overlap`` 0).

``exposed`` is the work not hidden (TP, the rest of DP, offload and the per-micro-step cost); ``step =
compute + optimizer + exposed``; tokens/s is the job's tokens per step over it, MFU the model FLOPs (no
recompute) over the peak. Collectives cost ``latency + bytes / bandwidth`` each.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Optional

from hybrid.config.stage_policy import StagePolicy, policy_for
from hybrid.plan.links import Quantization, ShardTopology, Span, step_collectives

DTYPE_BYTES = {"bf16": 2, "fp32": 4}
NVME_BYTES_PER_PARAM = 12  # hybrid.plan.memory's: fp32 master and both moments in the swap file
DEFAULT_BUCKET_NUMEL = 500_000_000  # hybrid.config.training.ZeroConfig.reduce_bucket_size
LOSS_CALLS = 3  # the vocab-parallel cross-entropy's all-reduces: max, sum of exponentials, target logit
# Eager ops per micro-step (forward and backward, the engine's hooks at stage 1 included) of a shape without a
# profile (``hybrid estimate``'s declared GPT shapes), counted with a TorchDispatchMode on the built-in GPT at 4 and 8
# layers: 122 per block, 63 more per block recomputed, 89 outside the blocks (embeddings, head, loss).
OPS_PER_BLOCK = 122
RECOMPUTE_OPS_PER_BLOCK = 63
OPS_OUTSIDE_BLOCKS = 89
# What the engine and TP add to a profiled model's own ops (``ModelShape.ops``: the model's forward, backward and
# recompute, measured on fake tensors) per micro-step: the ZeRO engine's gradient hooks and its input and loss
# handling, per parameter tensor and once (stage 0 reduces through a flat all-reduce buffer: more per tensor), and
# each TP collective's own ops. Counted on real gloo ranks (a TorchDispatchMode around forward and backward, less
# detach, as the profile counts) for the built-in GPT and a Hugging Face Llama at 2 and 4 layers, TP 1 and 2,
# stages 0, 1 and 3: tests/dist/test_engine_ops.py holds the prediction to the count.
ENGINE_OPS_PER_TENSOR = {0: 5, "sharded": 3}
ENGINE_OPS_FIXED = {0: 43, "sharded": 25}
OPS_PER_TP_CALL = 2
# Passes over a rank's Ψ/t parameters per micro-step at the device's memory bandwidth: the weights read in
# forward and in backward (2), each gradient written by its matmul and then added into the accumulated one
# (read both, write one: 4); activation checkpointing reads the weights once more.
PARAM_PASSES = 6


@dataclass(frozen=True)
class TpCalls:
    """The TP all-reduces one block makes per micro-step where a plan split it by module
    (``hybrid.tp.traffic.block_collectives``): ``forward`` calls (a rowwise module's output, an all_reduce style's)
    and ``backward`` calls (a colwise module's input gradient, a replicated parameter's gradient), each side's
    message width summed in elements per token (a parameter's gradient sum is latency only: 0 per token)."""

    forward: int
    backward: int
    forward_width: int
    backward_width: int
    by_style: tuple = ()  # (style, forward calls, backward calls, elements per token): where the calls come from


@dataclass(frozen=True)
class ModelShape:
    """A decoder-only transformer: Ψ and the shape its FLOPs and activations follow; from a measured profile
    (``from_profile``) also its FLOPs per token and eager ops, which then replace the GPT's formulas."""

    params: int
    layers: int
    hidden: int
    heads: int
    seq: int
    vocab: int
    mlp_ratio: int = 4
    flop_terms: Optional[tuple] = None       # (A, B): forward and backward FLOPs per token, A + B·seq
    recompute_terms: Optional[tuple] = None  # (A, B): what activation checkpointing adds per token
    ops: Optional[tuple] = None              # eager ops per micro-step: (plain, with activation checkpointing)
    tp_block: Optional[TpCalls] = None       # a block's TP calls by its plan (None: the GPT's 2 + 2 per block)
    tensors: int = 0                         # parameter tensors (a profiled model's; 0: not known)

    @property
    def matmul_params(self) -> int:
        """Ψ without the token and position embeddings (lookups, no FLOPs)."""
        return max(1, self.params - (self.vocab + self.seq) * self.hidden)

    @property
    def block_params(self) -> int:
        """The transformer blocks' parameters: what activation checkpointing recomputes (not the LM head)."""
        return max(0, self.matmul_params - self.vocab * self.hidden)

    def ops_per_micro_step(self, activation_checkpointing: bool = False, stage: int = 1, tp_calls: float = 0.0) -> int:
        """Eager ops one micro-step dispatches, whatever its size: a profiled model's own and what the engine at
        ``stage`` and ``tp_calls`` TP collectives add (see ``ENGINE_OPS_PER_TENSOR``); a declared shape's by the
        GPT's counts (``OPS_PER_BLOCK``)."""
        if self.ops is not None:
            key = 0 if stage == 0 else "sharded"
            engine = ENGINE_OPS_PER_TENSOR[key] * self.tensors + ENGINE_OPS_FIXED[key]
            return int(self.ops[bool(activation_checkpointing)] + engine + OPS_PER_TP_CALL * tp_calls)
        per_block = OPS_PER_BLOCK + (RECOMPUTE_OPS_PER_BLOCK if activation_checkpointing else 0)
        return self.layers * per_block + OPS_OUTSIDE_BLOCKS

    @classmethod
    def from_profile(cls, plain, checkpointed, seq: int, params: Optional[int] = None) -> "ModelShape":
        """From a model's measured profiles (``hybrid.plan.profile.ModelProfile``, without and with activation
        checkpointing) at ``seq`` tokens: its layers, residual width (TP's messages), FLOPs per token, the
        recompute's, its eager ops and parameter tensors, and a block's TP calls where the profile carries them;
        Ψ is ``params`` (default: the profile's count). Heads and vocabulary are not needed (0)."""
        a, c = plain.flop_terms, checkpointed.flop_terms
        return cls(params or plain.params, plain.layers, plain.width, 0, seq, 0,
                   flop_terms=(a.linear, a.quadratic),
                   recompute_terms=(max(0.0, c.linear - a.linear), max(0.0, c.quadratic - a.quadratic)),
                   ops=(plain.ops_per_micro_step(), checkpointed.ops_per_micro_step()),
                   tp_block=plain.tp_block, tensors=plain.tensors)


@dataclass(frozen=True)
class LinkOptions:
    """How ZeRO's collectives use the links (``hybrid.config.training.ZeroConfig``'s keys of the same names)."""

    shard_group: object = "all"        # "all" | "node" | a number of DP ranks
    hierarchical: bool = False
    secondary_shard: object = "none"   # "none" | "node" | a number of DP ranks
    quantized_weights: bool = False
    quantized_gradients: bool = False
    block: int = 256

    @property
    def label(self) -> str:
        parts = []
        if self.shard_group != "all":
            parts.append(f"shard {self.shard_group}")
        if self.hierarchical:
            parts.append("2-level")
        if self.secondary_shard != "none":
            parts.append("hpZ")
        q = "w" * self.quantized_weights + "g" * self.quantized_gradients
        if q:
            parts.append(f"int8 {q}")
        return "+".join(parts)

    def zero(self) -> dict:
        """These options as ``zero`` keys (the defaults left out)."""
        out = {}
        for key, off in (("shard_group", "all"), ("hierarchical", False), ("secondary_shard", "none")):
            if getattr(self, key) != off:
                out[key] = getattr(self, key)
        for key in ("quantized_weights", "quantized_gradients"):
            if getattr(self, key):
                out[key] = "int8"
        return out

    def quantization(self) -> Quantization:
        return Quantization(self.quantized_weights, self.quantized_gradients, self.block)

    @classmethod
    def from_zero(cls, zero: dict) -> "LinkOptions":
        """The options of ``zero`` keys (``zero()``'s form; a ``ZeroConfig``'s values)."""
        return cls(zero.get("shard_group", "all"), bool(zero.get("hierarchical", False)),
                   zero.get("secondary_shard", "none"), zero.get("quantized_weights", "none") != "none",
                   zero.get("quantized_gradients", "none") != "none", zero.get("quantization_block", 256))


FLAT = LinkOptions()


@dataclass(frozen=True)
class Layout:
    """One way to run the job: mesh, ZeRO stage, levers, micro-batch and accumulation, and how ZeRO's collectives
    use the links."""

    nodes: int
    gpus_per_node: int
    tp: int
    stage: int
    micro_batch: int
    accumulation: int = 1
    activation_checkpointing: bool = False
    offload: bool = False
    precision: str = "bf16"
    links: LinkOptions = FLAT
    nvme: bool = False  # with offload: the optimizer states on the node's disk, not in host memory

    @property
    def world(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def dp(self) -> int:
        return self.world // self.tp

    @property
    def rows_per_rank(self) -> int:
        """Sequences one DP rank trains per optimizer step."""
        return self.micro_batch * self.accumulation

    @property
    def global_batch(self) -> int:
        return self.rows_per_rank * self.dp

    @property
    def policy(self) -> StagePolicy:
        return policy_for(self.stage)

    @property
    def dp_per_node(self) -> int:
        """DP ranks of one DP group on each node (TP groups inside a node)."""
        return max(1, self.gpus_per_node // self.tp)

    def topology(self) -> ShardTopology:
        """How ``links`` cut the DP group (``hybrid.plan.links``; ``ConfigError`` where they cannot)."""
        nodes = [r // self.dp_per_node for r in range(self.dp)]
        if not self.policy.shard_optimizer:
            return ShardTopology.of(nodes)
        lk = self.links
        return ShardTopology.of(nodes, lk.shard_group, lk.hierarchical,
                                lk.secondary_shard if self.policy.shard_params else "none")

    @property
    def label(self) -> str:
        batch = f"mb {self.micro_batch}" + (f"x{self.accumulation}" if self.accumulation > 1 else "")
        levers = "".join(text for on, text in ((self.activation_checkpointing, " AC"),
                                               (self.offload, " nvme" if self.nvme else " off")) if on)
        links = f" {self.links.label}" if self.links.label else ""
        return f"tp{self.tp} z{self.stage} {batch}{levers}{links}"


@dataclass(frozen=True)
class Link:
    """A path collectives take: ``latency + bytes / bandwidth`` per call. ``bandwidth`` is the ring's bus
    bandwidth (nccl-tests' busbw: bytes each rank sends over the time), one direction."""

    bandwidth: float
    latency: float
    source: str = ""

    def time(self, nbytes: float, calls: float = 1.0) -> float:
        return calls * self.latency + nbytes / self.bandwidth


@dataclass(frozen=True)
class Disk:
    """A node's local disk for NVMe offload's swap files: sequential bytes/s of all its drives together."""

    read: float
    write: float
    source: str = ""


@dataclass(frozen=True)
class Hardware:
    """What the cost model knows of the machines, each figure with where it came from."""

    device: str             # the GPU's NVML name, or "cpu"
    peak_flops: float       # per GPU, in the training precision
    compute_efficiency: float
    optimizer_rate: float   # parameters per second the device's optimizer steps
    intra: Link             # one GPU's link to the others of its node (TP; DP inside one node)
    inter: Link             # one node's NICs together (DP across nodes)
    pcie: Link              # one GPU's host link (offload copies)
    host_adam_rate: float   # parameters per second the host steps for one rank (offload)
    overlap: float          # fraction of overlappable traffic hidden behind compute
    sources: tuple = ()     # (figure, where it came from) pairs, for the plan's text
    nvme: Optional[Disk] = None  # one node's disk (NVMe offload); build_hardware fills it from its table
    op_overhead: float = 0.0       # seconds of host time per eager op (dispatch, autograd, launch)
    memory_bandwidth: float = 0.0  # device memory, bytes/s (0: the parameters' passes are not priced)

    def scaled(self, compute: float = 1.0) -> "Hardware":
        """This hardware with the compute efficiency scaled (calibration)."""
        return replace(self, compute_efficiency=self.compute_efficiency * compute)

    def slowed(self, factor: float, why: str = "") -> "Hardware":
        """This hardware ``factor`` times slower in every figure -- rates divided, latencies and per-op overheads
        multiplied, the overlap kept -- so that every layout's predicted step is ``factor`` times as long and the
        ranking is unchanged: a whole-step calibration from a measured step (``why`` goes into the sources)."""
        def link(l: Link) -> Link:
            return replace(l, bandwidth=l.bandwidth / factor, latency=l.latency * factor)

        disk = None if self.nvme is None else replace(self.nvme, read=self.nvme.read / factor,
                                                      write=self.nvme.write / factor)
        return replace(self, compute_efficiency=self.compute_efficiency / factor,
                       optimizer_rate=self.optimizer_rate / factor, intra=link(self.intra), inter=link(self.inter),
                       pcie=link(self.pcie), host_adam_rate=self.host_adam_rate / factor, nvme=disk,
                       op_overhead=self.op_overhead * factor, memory_bandwidth=self.memory_bandwidth / factor,
                       sources=self.sources + ((("calibration", why),) if why else ()))


@dataclass(frozen=True)
class StepCost:
    layout: Layout
    compute_s: float        # forward + backward, recompute included
    recompute_s: float      # of which activation checkpointing's recompute
    optimizer_s: float      # the device optimizer step (0 with offload)
    tp_s: float             # TP all-reduces
    dp_s: float             # ZeRO collectives, all of them
    dp_hidden_s: float      # of which hidden behind compute
    offload_s: float        # PCIe copies and the host optimizer
    offload_hidden_s: float
    tp_bytes: float         # per GPU per step
    dp_bytes: float
    pcie_bytes: float
    model_flops: float      # per GPU per step, without recompute (MFU's numerator)
    tokens: int             # the job's tokens per step
    peak_flops: float
    terms: dict = field(default_factory=dict)  # the sub-terms, for tests and --json
    nvme_s: float = 0.0     # NVMe offload: the disk's time for the swap file's read and write (in offload_s)
    nvme_read_bytes: float = 0.0   # per GPU per step: its swap file read once
    nvme_write_bytes: float = 0.0  # and written once
    micro_s: float = 0.0           # the per-micro-step cost, all k of them (ops and parameter passes)
    micro_hidden_s: float = 0.0    # of which hidden behind the device's work

    @property
    def exposed_s(self) -> float:
        return (self.tp_s + (self.dp_s - self.dp_hidden_s) + (self.offload_s - self.offload_hidden_s)
                + (self.micro_s - self.micro_hidden_s))

    @property
    def step_s(self) -> float:
        return self.compute_s + self.optimizer_s + self.exposed_s

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.step_s

    @property
    def tokens_per_s_per_gpu(self) -> float:
        return self.tokens_per_s / self.layout.world

    @property
    def mfu(self) -> float:
        return self.model_flops / (self.step_s * self.peak_flops)

    def as_dict(self) -> dict:
        return {"layout": self.layout.label, "compute_s": self.compute_s, "recompute_s": self.recompute_s,
                "optimizer_s": self.optimizer_s, "tp_s": self.tp_s, "dp_s": self.dp_s,
                "dp_hidden_s": self.dp_hidden_s, "offload_s": self.offload_s,
                "offload_hidden_s": self.offload_hidden_s, "exposed_s": self.exposed_s, "step_s": self.step_s,
                "tp_bytes": self.tp_bytes, "dp_bytes": self.dp_bytes, "pcie_bytes": self.pcie_bytes,
                "nvme_s": self.nvme_s, "nvme_read_bytes": self.nvme_read_bytes,
                "nvme_write_bytes": self.nvme_write_bytes, "micro_s": self.micro_s,
                "micro_hidden_s": self.micro_hidden_s,
                "model_flops": self.model_flops, "tokens": self.tokens, "tokens_per_s": self.tokens_per_s,
                "tokens_per_s_per_gpu": self.tokens_per_s_per_gpu, "mfu": self.mfu, **self.terms}


# ------------------------------------------------------------------------------------------------ terms


def compute_flops(model: ModelShape, layout: Layout) -> tuple[float, float]:
    """``(model FLOPs, recompute FLOPs)`` per GPU per step."""
    tokens = layout.rows_per_rank * model.seq
    if model.flop_terms is not None:  # measured (from_profile)
        per_token = model.flop_terms[0] + model.flop_terms[1] * model.seq
        again = model.recompute_terms[0] + model.recompute_terms[1] * model.seq if model.recompute_terms else 0.0
        recompute = again * tokens / layout.tp if layout.activation_checkpointing else 0.0
        return float(per_token * tokens / layout.tp), float(recompute)
    attention = 12 * model.layers * model.hidden * model.seq
    flops = (6 * model.matmul_params + attention) * tokens / layout.tp
    recompute = 0.0
    if layout.activation_checkpointing:
        recompute = (2 * model.block_params + attention / 3) * tokens / layout.tp
    return float(flops), float(recompute)


def tp_traffic(model: ModelShape, layout: Layout) -> tuple[float, float]:
    """``(bytes each rank sends, collective calls)`` of TP per step (0 at t = 1)."""
    t = layout.tp
    if t == 1:
        return 0.0, 0.0
    item = DTYPE_BYTES[layout.precision]
    tokens = layout.micro_batch * model.seq
    ring = 2 * (t - 1) / t
    ac = layout.activation_checkpointing  # the recompute repeats the forward's calls
    if model.tp_block is not None:  # counted from the model's plan
        b = model.tp_block
        block_calls = b.forward * (2 if ac else 1) + b.backward
        block_width = b.forward_width * (2 if ac else 1) + b.backward_width
    else:  # the GPT's: attention's and the MLP's output in forward, their input gradients in backward
        block_calls = 4 + (2 if ac else 0)
        block_width = block_calls * model.hidden
    outside = 2  # the embedding's output and the head's input gradient
    per_micro = ((block_width * model.layers + outside * model.hidden) * ring * tokens * item
                 + LOSS_CALLS * ring * tokens * 4)
    calls = block_calls * model.layers + outside + LOSS_CALLS
    return per_micro * layout.accumulation, float(calls * layout.accumulation)


PHASES = ("forward", "backward", "boundary", "after")


@dataclass(frozen=True)
class DpTraffic:
    """ZeRO's collectives per step (``hybrid.plan.links.Collective``), and their bytes per rank (ring-normalized)
    and calls by when they can overlap compute: ``forward`` (stage-3 gathers, prefetched), ``backward``
    (gradient reduction, stage-3 gathers in backward), ``boundary`` (the replicas' all-reduce, under the last
    micro-step's backward), ``after`` (the after-step all-gather, never hidden)."""

    collectives: tuple = ()
    last_micro_only: bool = False  # the backward traffic waits for the last micro-step (unsharded gradients)

    def _phase(self, phase: str) -> list:
        return [c for c in self.collectives if c.phase == phase]

    def bytes_in(self, phase: str) -> float:
        return sum(c.ring_bytes for c in self._phase(phase))

    def calls_in(self, phase: str) -> float:
        return sum(c.calls for c in self._phase(phase))

    @property
    def forward(self) -> float:
        return self.bytes_in("forward")

    @property
    def backward(self) -> float:
        return self.bytes_in("backward")

    @property
    def after(self) -> float:
        return self.bytes_in("after")

    @property
    def total(self) -> float:
        return sum(c.ring_bytes for c in self.collectives)

    @property
    def calls(self) -> float:
        return sum(c.calls for c in self.collectives)

    def links(self) -> dict:
        """``{"intra": bytes, "inter": bytes}`` per rank per step, as ``hybrid.comm`` counts them."""
        intra = inter = 0.0
        for c in self.collectives:
            a, b = c.split()
            intra, inter = intra + float(a), inter + float(b)
        return {"intra": intra, "inter": inter}


def cost_units(model: ModelShape, layout: Layout, bucket_numel: int = DEFAULT_BUCKET_NUMEL) -> list:
    """The units the cost model prices, in elements per rank: stage 3's module units (the blocks, the
    embeddings, the head: ``layers + 2`` equal parts of Ψ/t), else gradient buckets of ``bucket_numel``."""
    local = model.params / layout.tp
    pieces = model.layers + 2 if layout.policy.module_units else max(1, math.ceil(local / bucket_numel))
    return [local / pieces] * pieces


def dp_traffic(model: ModelShape, layout: Layout, bucket_numel: int = DEFAULT_BUCKET_NUMEL) -> DpTraffic:
    """What the stage's policy moves over the DP group per step, under the layout's link options (see the
    module docstring)."""
    if layout.dp == 1:
        return DpTraffic()
    p = layout.policy
    item = DTYPE_BYTES[layout.precision]
    collectives = step_collectives(cost_units(model, layout, bucket_numel), (), p, layout.topology(), item, item,
                                   layout.accumulation, layout.links.quantization())
    return DpTraffic(tuple(collectives), last_micro_only=not p.shard_grads)


def collective_seconds(c, layout: Layout, hw: Hardware) -> float:
    """Seconds of the collectives ``c`` (a ``Collective``, all its calls, or ``_Priced``): inside one node on the rank's
    own link; across nodes the node's NICs carry one crossing per ring of the node's ranks on it, and where a
    ring has several ranks on a node their intra-node hops run at the same time."""
    ring, span = c.ring_bytes, c.span
    if ring == 0:
        return 0.0
    if span.nodes <= 1:
        return hw.intra.time(ring, c.calls)
    across = hw.inter.time(ring * layout.gpus_per_node * span.nodes / span.size, c.calls)
    inside = hw.intra.time(ring, c.calls) if span.size > span.nodes else 0.0
    return max(across, inside)


def dp_seconds(traffic: DpTraffic, phase: str, layout: Layout, hw: Hardware) -> float:
    """Seconds of a phase's collectives: those on groups of the same span priced as one ring (their bytes and
    calls together), the groups one after the other."""
    by_span: dict = {}
    for c in traffic._phase(phase):
        nbytes, calls = by_span.get(c.span, (0.0, 0.0))
        by_span[c.span] = (nbytes + c.ring_bytes, calls + c.calls)
    return sum(collective_seconds(_Priced(b, calls, span), layout, hw) for span, (b, calls) in by_span.items())


@dataclass(frozen=True)
class _Priced:
    """Ring bytes and calls of one span's collectives, as ``collective_seconds`` prices them."""

    ring_bytes: float
    calls: float
    span: Span


def _hidden(traffic: float, window: float, overlap: float) -> float:
    return overlap * min(traffic, window)


def step_cost(model: ModelShape, layout: Layout, hw: Hardware, bucket_numel: int = DEFAULT_BUCKET_NUMEL) -> StepCost:
    """The cost of one optimizer step of ``layout`` on ``hw`` (see the module docstring)."""
    flops, recompute_flops = compute_flops(model, layout)
    rate = hw.peak_flops * hw.compute_efficiency
    compute, recompute = (flops + recompute_flops) / rate, recompute_flops / rate
    forward = flops / 3 / rate
    backward = compute - forward

    tp_bytes, tp_calls = tp_traffic(model, layout)
    tp = hw.intra.time(tp_bytes, tp_calls) if layout.tp > 1 else 0.0

    d = dp_traffic(model, layout, bucket_numel)
    dp_forward = dp_seconds(d, "forward", layout, hw)
    dp_backward = dp_seconds(d, "backward", layout, hw)
    dp_boundary = dp_seconds(d, "boundary", layout, hw)
    dp_after = dp_seconds(d, "after", layout, hw)
    last_micro = backward / layout.accumulation
    backward_window = last_micro if d.last_micro_only else backward
    dp_hidden = (_hidden(dp_forward, forward, hw.overlap) + _hidden(dp_backward, backward_window, hw.overlap)
                 + _hidden(dp_boundary, max(0.0, last_micro - dp_backward), hw.overlap))

    shard = model.params / layout.tp / (layout.topology().shard if layout.policy.shard_optimizer else 1)
    optimizer = offload = offload_hidden = pcie_bytes = nvme = swapped = 0.0
    if layout.offload:
        item = DTYPE_BYTES[layout.precision]
        to_host, to_device = shard * item, shard * item  # the gradient shard out, the updated parameters in
        pcie_bytes = to_host + to_device
        host = shard / hw.host_adam_rate
        if layout.nvme:  # the swap file read and written once; the node's ranks share the disk
            swapped = NVME_BYTES_PER_PARAM * shard
            nvme = nvme_seconds(swapped, layout.gpus_per_node, _node_disk(hw))
        copy_out, copy_in = hw.pcie.time(to_host), hw.pcie.time(to_device)
        offload = copy_out + max(host, nvme) + copy_in
        offload_hidden = _hidden(copy_out, max(0.0, backward_window - (dp_backward - dp_hidden)), hw.overlap)
    else:
        optimizer = shard / hw.optimizer_rate

    dp = dp_forward + dp_backward + dp_boundary + dp_after
    micro, micro_ops, micro_bytes = micro_step_seconds(model, layout, hw, tp_calls)
    # the host dispatches while the device works: under all of the device's time, exposed traffic included
    # (step = device + micro - overlap * min(micro, device): never slower for a faster device or link)
    device = compute + optimizer + tp + (dp - dp_hidden) + (offload - offload_hidden)
    micro_hidden = _hidden(micro, device, hw.overlap)

    links = d.links()
    terms = {"micro_ops": micro_ops, "micro_param_bytes": micro_bytes, "forward_s": forward,
             "backward_s": backward, "tp_calls": tp_calls, "dp_forward_s": dp_forward, "dp_backward_s": dp_backward,
             "dp_boundary_s": dp_boundary, "dp_after_s": dp_after, "dp_calls": d.calls,
             "optimizer_params": shard, "dp_intra_bytes": links["intra"], "dp_inter_bytes": links["inter"]}
    return StepCost(layout, compute, recompute, optimizer, tp, dp, dp_hidden,
                    offload, offload_hidden, tp_bytes, d.total, pcie_bytes, flops,
                    layout.global_batch * model.seq, hw.peak_flops, terms, nvme, swapped, swapped, micro,
                    micro_hidden)


def micro_step_seconds(model: ModelShape, layout: Layout, hw: Hardware,
                       tp_calls: float) -> tuple[float, float, float]:
    """Seconds, ops and parameter bytes of a step's k micro-steps that do not depend on their size (see the
    module docstring's "per micro-step"); ``tp_calls``: the step's TP collectives (``tp_traffic``'s count)."""
    ops = model.ops_per_micro_step(layout.activation_checkpointing, layout.stage,
                                   tp_calls / layout.accumulation) * layout.accumulation
    passes = PARAM_PASSES + (1 if layout.activation_checkpointing else 0)
    nbytes = passes * model.params / layout.tp * DTYPE_BYTES[layout.precision] * layout.accumulation
    seconds = ops * hw.op_overhead + (nbytes / hw.memory_bandwidth if hw.memory_bandwidth > 0 else 0.0)
    return seconds, float(ops), nbytes


def nvme_seconds(nbytes: float, ranks_per_node: int, disk: Disk) -> float:
    """Seconds a rank's ``nbytes`` swap file takes to be read and then written back on a disk its node's
    ``ranks_per_node`` ranks share."""
    return nbytes * ranks_per_node / disk.read + nbytes * ranks_per_node / disk.write


def _node_disk(hw: Hardware) -> Disk:
    """The disk an NVMe layout swaps to: ``hw.nvme``, which ``hybrid.plan.hardware.build_hardware`` always fills
    (this module defines the types the tables are made of, so it does not read the tables itself)."""
    if hw.nvme is None:
        raise ValueError("an NVMe-offload layout needs Hardware.nvme (a node's disk); build the hardware with "
                         "hybrid.plan.hardware.build_hardware or give Hardware(..., nvme=Disk(...)).")
    return hw.nvme


def calibrate(hw: Hardware, predicted: StepCost, measured_step_s: float) -> tuple[Hardware, float]:
    """``hw`` with its compute efficiency refitted from one run, and the factor applied to it: the run's
    layout was predicted at ``predicted`` and took ``measured_step_s``. One run gives one number, so only
    compute is refitted and the step's other terms are taken as predicted; where those alone reach the
    measurement, compute is scaled by the whole step's ratio instead. The factor stays within
    ``CALIBRATION_RANGE``: a run far outside it measured something else (a stall, a cold start)."""
    if measured_step_s <= 0 or predicted.step_s <= 0 or predicted.compute_s <= 0:
        return hw, 1.0
    rest = predicted.step_s - predicted.compute_s
    if measured_step_s > rest * 1.05:
        factor = predicted.compute_s / (measured_step_s - rest)
    else:
        factor = predicted.step_s / measured_step_s
    lo, hi = CALIBRATION_RANGE
    factor = min(hi, max(lo, factor))
    return hw.scaled(factor), factor


CALIBRATION_RANGE = (0.05, 20.0)
