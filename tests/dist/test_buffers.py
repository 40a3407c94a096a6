"""Persistent buffers updated in forward (BatchNorm running statistics) agree on every DP rank after each
optimizer step: DP rank 0's copy is broadcast, as DDP does, so an eval forward on any rank and the
checkpoint (which saves rank 0's) see the same values. Non-persistent buffers are left alone.
``full_state_dict(rank0_only=True)`` gives DP rank 0 the full weights and every other rank nothing."""

import pytest
import torch
import torch.distributed as dist
from torch import nn

import hybrid
from hybrid.runtime.local_launch import run_local

pytestmark = pytest.mark.slow

STEPS, ROWS = 3, 4


class BatchNormNet(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Linear(6, 1))
        self.register_buffer("rank_scratch", torch.zeros(()), persistent=False)

    def forward(self, x, y):
        self.rank_scratch.fill_(dist.get_rank())
        return ((self.body(x) - y) ** 2).mean()


def _train(stage):
    rank = dist.get_rank()
    engine = hybrid.initialize(BatchNormNet(), {"zero_optimization": {"stage": stage},
                                                "gradient_accumulation_steps": 2})
    midway = None
    for step in range(STEPS * 2):
        g = torch.Generator().manual_seed(step * 100 + rank)  # every rank its own rows
        x, y = torch.randn(ROWS, 4, generator=g), torch.randn(ROWS, 1, generator=g)
        engine.backward(engine(x, y))
        engine.step()
        if step == 2:  # between the micro-steps of an optimizer step: each rank's statistics differ
            midway = engine.full_state_dict()["body.1.running_mean"]
    full, only0 = engine.full_state_dict(), engine.full_state_dict(rank0_only=True)
    assert only0.keys() == full.keys() and all(torch.equal(only0[k], full[k]) for k in full) if rank == 0 \
        else only0 == {}
    bn = engine.module.body[1]
    return bn.running_mean.clone(), bn.running_var.clone(), int(bn.num_batches_tracked), \
        float(engine.module.rank_scratch), midway


@pytest.mark.parametrize("stage", [0, 3])
def test_running_statistics_agree_on_every_rank(stage):
    out = run_local(_train, 3, stage, timeout_s=120)
    mean0, var0, tracked0, _, midway0 = out[0]
    assert tracked0 == STEPS * 2 and not torch.equal(mean0, torch.zeros(6))
    for rank, (mean, var, tracked, scratch, midway) in enumerate(out):
        assert torch.equal(mean, mean0) and torch.equal(var, var0) and tracked == tracked0, f"rank {rank}"
        assert torch.equal(midway, midway0), "full_state_dict() gives DP rank 0's buffers on every rank"
        assert scratch == rank  # a non-persistent buffer is not synchronised


class OwnDtypes(nn.Module):
    """A buffer kept in fp64 on purpose (an offset fp32 cannot hold: 1e8 + 1), a frozen integer parameter (an
    index table) and an fp32 buffer that follows the model's precision."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(3, 1)
        self.register_buffer("origin", torch.tensor(1e8 + 1, dtype=torch.float64))
        self.register_buffer("scale", torch.tensor(0.5))
        self.perm = nn.Parameter(torch.tensor([2, 0, 1]), requires_grad=False)

    def forward(self, x, y):
        shift = (self.origin - 1e8).to(x.dtype)  # 1 in fp64; 0 had the buffer been rounded to fp32 or bf16
        return ((self.lin(x[:, self.perm]) * self.scale + shift - y.to(x.dtype)) ** 2).float().mean()


def _own_dtypes(precision):
    engine = hybrid.initialize(OwnDtypes(), {"zero_optimization": {"stage": 3},
                                             "bf16": {"enabled": precision == "bf16"}})
    x = torch.ones(4, 3, dtype=torch.bfloat16 if precision == "bf16" else torch.float32)
    loss = engine(x, torch.zeros(4, 1)).item()
    sd = engine.full_state_dict()
    m = engine.module
    return loss, (m.origin.dtype, m.scale.dtype), {k: v.dtype for k, v in sd.items()}, sd["origin"].item()


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_tensors_kept_in_their_own_dtype_stay_in_it(precision):
    """Only the tensors in the model's own dtype follow it into the run's precision (as ``module.to`` would
    take them); before, an fp64 buffer was rounded to fp32 in an fp32 run (the loss changed without a word)
    and a frozen integer parameter came out of ``full_state_dict()`` as fp32."""
    ref = OwnDtypes()
    expected = ref(torch.ones(4, 3), torch.zeros(4, 1)).item()
    run = torch.bfloat16 if precision == "bf16" else torch.float32
    for loss, dtypes, exported, origin in run_local(_own_dtypes, 2, precision, timeout_s=120):
        assert dtypes == (torch.float64, run)
        assert exported == {"lin.weight": torch.float32, "lin.bias": torch.float32, "origin": torch.float64,
                            "scale": torch.float32, "perm": torch.int64}
        assert origin == 1e8 + 1
        if precision == "fp32":
            assert loss == pytest.approx(expected, rel=1e-6)
