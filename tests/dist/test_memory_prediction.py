"""The memory prediction against the measurement, on real gloo ranks (CPU: peak RSS growth).

The built-in GPT at 52.6M parameters (vocab 8192, hidden 512, 14 layers, seq 128, micro-batch 4), DP 2,
stages 0-3, fp32 and bf16: each rank makes a ``MemoryMeter`` before building the model on meta (as
``hybrid.runtime.train.Context`` does), trains two steps in fp32 and three in bf16 (``STEPS``), and its
measured peak RSS growth is within 15 % of ``hybrid.plan.memory.predict_memory(...).total`` (the engine's real
layout, gloo's reduce-scatter copies, the GPT's activations by its profile as the plan takes them, the CPU runtime
reserve). Each case runs in fresh
processes (RSS is per process).
With and without activation checkpointing: each stage with both precisions and both, each precision with
both (8 cases); stage 2 on DP 3 and stage 3 on DP 4.
Figures, as the test prints them, are in bench/RESULTS.md.
"""


import pytest
import torch

import hybrid
from hybrid.config.training import TrainConfig, ZeroConfig
from hybrid.plan.cpu_bf16 import SLOW_FACTOR, bf16_matmul_slowdown
from hybrid.runtime.local_launch import run_local
from hybrid.plan.memory import DEFAULT_CPU_RUNTIME_RESERVE_GB, GB, predict_memory
from hybrid.zero.units import model_units
from hybrid.plan.budget import MemoryMeter
from hybrid.models.gpt.model import GPT, GPTConfig
from launch.planning.model_size import gpt_figures

pytestmark = pytest.mark.slow

SHAPE = dict(vocab_size=8192, seq_len=128, n_layers=14, hidden=512, n_heads=8)
MICRO_BATCH, DP, TOLERANCE = 4, 2, 0.15
# Steps per case, each most of a case's time: until the peak stops growing. fp32: the second step is the first
# steady-state one (every buffer live), and the peak after a third equalled the second's within 0.3 % at stages
# 0-3 on DP 2 and 4. bf16: stage 2 on DP 3 still grew 3.5 % in its third step. (The driver measures after each
# of the first three steps.)
STEPS = {"fp32": 2, "bf16": 3}
AC_FIELD = "activation_checkpointing"


def _case(stage: int, precision: str, checkpointing: bool, dp: int = DP) -> dict:
    import torch.distributed as dist

    shape = dict(SHAPE, **({AC_FIELD: True} if checkpointing else {}))
    meter = MemoryMeter("cpu")
    model = GPT(GPTConfig(**shape), device="meta")
    modules = model_units(model)
    engine = hybrid.initialize(model, TrainConfig(zero=ZeroConfig(stage=stage), precision=precision,
                                                  gradient_clipping=1.0))
    g = torch.Generator().manual_seed(dist.get_rank())
    for _ in range(STEPS[precision]):
        x = torch.randint(0, SHAPE["vocab_size"], (MICRO_BATCH, SHAPE["seq_len"]), generator=g)
        loss = engine(x, x)
        engine.backward(loss)
        engine.step()
    measured = meter.measure()["peak_bytes"]
    activations = gpt_figures(GPTConfig(**SHAPE).to_dict(), precision).activation_bytes(MICRO_BATCH, 1, checkpointing)
    predicted = predict_memory(modules, dp, stage, precision, activations=activations, device="cpu",
                               runtime_reserve=DEFAULT_CPU_RUNTIME_RESERVE_GB * GB)
    return {"measured": measured, "predicted": predicted.total, "parts": predicted.as_dict(),
            "params": sum(modules.numels)}


# Every pair of (stage, precision, checkpointing) values occurs (a covering array: 8 runs instead of 16), on
# DP 2; and the sharded stages on 3 and 4 ranks.
CASES = [(stage, precision, (stage + (precision == "bf16")) % 2 == 1, DP)
         for stage in (0, 1, 2, 3) for precision in ("fp32", "bf16")] + [(2, "bf16", False, 3), (3, "fp32", True, 4)]


# The DP 4 case is `make test-all`'s (marked extended: 34 CPU-s): `make test` keeps the eight DP-2 runs and the
# DP-3 one, and the shard arithmetic at other DP sizes is tests/unit's (pure layout functions the engine and the
# model share).
EXTENDED = {(3, "fp32", True, 4)}


@pytest.mark.parametrize("stage, precision, checkpointing, dp",
                         [pytest.param(*c, marks=pytest.mark.extended) if c in EXTENDED else c for c in CASES],
                         ids=[f"{s}-{p}-{'ac' if c else 'no-ac'}-dp{n}" for s, p, c, n in CASES])
def test_prediction_within_15_percent_of_measured_peak(stage, precision, checkpointing, dp):
    """Over 20 s on DP 4 (4 ranks on a 2-core machine), 7-14 s on DP 2: a 52.6M-parameter model so that the
    model states dominate the fixed runtime reserve (a smaller one would pass the 15 % band with a part of the
    prediction missing), micro-batch 4 x 128 tokens so that the activations are a quarter of the total, and
    steps until the peak stops growing (``STEPS``)."""
    if precision == "bf16" and bf16_matmul_slowdown() >= SLOW_FACTOR:
        pytest.skip("this CPU has no native bf16 matmul (AVX2 only): one bf16 step of the 52.6M GPT takes minutes")
    results = run_local(_case, dp, stage, precision, checkpointing, dp, timeout_s=600)
    assert results[0]["params"] >= 50_000_000
    for rank, r in enumerate(results):
        dev = (r["measured"] - r["predicted"]) / r["predicted"]
        print(f"stage {stage} {precision} ac={checkpointing} dp {dp} rank {rank}: predicted {r['predicted'] / 1e6:.1f} MB, "
              f"measured {r['measured'] / 1e6:.1f} MB ({100 * dev:+.1f}%) {r['parts']}")
        assert abs(dev) <= TOLERANCE, (rank, r)
