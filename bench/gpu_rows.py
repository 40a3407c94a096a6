"""What the single-GPU benchmark measures, and what it should cost (pure: no torch, no CUDA).

``rows(kind)`` lists the rows in the order they run, the ones the report needs most first: hybrid's engine at
ZeRO stages 0-3 (every collective issued for real on the one GPU, ``HYBRID_FORCE_COLLECTIVES=1``) and FSDP2
``fully_shard``, then the same with activation checkpointing (in the CPU dry run, stage 3's only), then stage 3
with the optimizer offloaded to pinned host memory. Both implementations reduce gradients in ``REDUCE_DTYPE`` (hybrid's
``zero.reduce_dtype``, FSDP2's ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=...)``).

``STEPS`` are budgeted from the model's FLOPs: ``row_estimate_s`` is a row's start-up plus its steps at
``ASSUMED_MFU`` of the GPU's bf16 peak (recomputation adds a forward: x4/3; an offloaded step adds the host
optimizer's ``OFFLOAD_STEP_S``). On one H200 the ~1.4B GPT's step (micro-batch 4 x 2048 tokens, 9.7 GFLOP a
token) is ~0.23 s at 35 % MFU, so every row is dominated by its start-up.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

REDUCE_DTYPE = "fp32"
MICRO_BATCH = {"cuda": 4, "cpu": 2}
# (untimed warm-up steps, timed steps); an offloaded step costs seconds (the host's AdamW over 1.4B values)
STEPS = {"cuda": (2, 5), "cpu": (1, 2)}
OFFLOAD_STEPS = {"cuda": (1, 2), "cpu": (1, 2)}
ASSUMED_MFU = 0.35
START_S = {"cuda": 8.0, "cpu": 2.0}  # a row's model and engine construction (a 1.4B model on the GPU: seconds)
PROCESS_START_S = {"cuda": 20.0, "cpu": 8.0}  # the measuring process: torch, CUDA context, process group
OFFLOAD_STEP_S = {"cuda": 4.0, "cpu": 1.0}  # the host optimizer step and the copies, 1.4B parameters
OFFLOAD_START_S = {"cuda": 15.0, "cpu": 1.0}  # pinning ~23 GB of host memory for the states

# Dense bf16 tensor-core peak per GPU, FLOP/s, by a substring of torch.cuda.get_device_name().
PEAK_BF16 = (("H200", 989e12), ("H100", 989e12), ("H800", 989e12), ("A100", 312e12), ("A800", 312e12))


@dataclass(frozen=True)
class RowSpec:
    impl: str           # "hybrid" | "fsdp2"
    stage: int          # hybrid's ZeRO stage (FSDP2: 3, it shards everything)
    checkpointing: bool
    offload: bool = False

    @property
    def key(self) -> str:
        """A short unique name (the ``--rows`` filter, the JSONL ``row`` field)."""
        name = f"hybrid-{self.stage}" if self.impl == "hybrid" else "fsdp2"
        return name + ("-offload" if self.offload else "") + ("-ac" if self.checkpointing else "")

    @property
    def label(self) -> str:
        """The report's implementation column."""
        if self.impl == "fsdp2":
            return "FSDP2 fully_shard"
        return f"hybrid ZeRO-{self.stage}" + (" + offload" if self.offload else "")


def rows(kind: str) -> list[RowSpec]:
    """Every row, in the order they run (see the module docstring); ``kind`` is "cuda" or "cpu"."""
    plain = [RowSpec("hybrid", s, False) for s in range(4)] + [RowSpec("fsdp2", 3, False)]
    # The CPU dry run proves each path once: every stage's collectives in the plain rows, recomputation (the same
    # code at every stage) once per implementation; the GPU report wants every stage's recomputed figures.
    recomputed_stages = range(4) if kind == "cuda" else (3,)
    recomputed = [RowSpec("hybrid", s, True) for s in recomputed_stages] + [RowSpec("fsdp2", 3, True)]
    return plain + recomputed + [RowSpec("hybrid", 3, False, offload=True)]


def steps(spec: RowSpec, kind: str) -> tuple[int, int]:
    """(warm-up, timed) steps of ``spec`` on ``kind``."""
    return (OFFLOAD_STEPS if spec.offload else STEPS)[kind]


def peak_bf16_flops(device_name: str) -> Optional[float]:
    """The dense bf16 peak of the GPU called ``device_name``, or None when it is not in ``PEAK_BF16``."""
    for key, peak in PEAK_BF16:
        if key in device_name:
            return peak
    return None


def flops_per_token(params: int, layers: int, hidden: int, seq_len: int) -> int:
    """Model FLOPs of one token's forward and backward pass: ``6·N + 12·L·h·s`` (the PaLM paper's count:
    weights forward and backward, plus attention scores, not halved for the causal mask)."""
    return 6 * params + 12 * layers * hidden * seq_len


def row_estimate_s(spec: RowSpec, kind: str, step_flops: float, peak: Optional[float]) -> float:
    """Seconds ``spec`` should take on ``kind``: construction plus its steps (see the module docstring);
    without a known peak only the construction and the offloaded steps are counted."""
    warmup, timed = steps(spec, kind)
    compute = step_flops * (4 / 3 if spec.checkpointing else 1) / (ASSUMED_MFU * peak) if peak else 0.0
    per_step = compute + (OFFLOAD_STEP_S[kind] if spec.offload else 0.0)
    start = START_S[kind] + (OFFLOAD_START_S[kind] if spec.offload else 0.0)
    return start + (warmup + timed) * per_step


def row_timeout_s(estimate_s: float) -> float:
    """How long a row may run before it counts as hung: several times its estimate, two minutes at least."""
    return max(120.0, 5 * estimate_s)
