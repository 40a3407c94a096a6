"""Persistent buffers updated in forward (BatchNorm running statistics) agree on every DP rank after each
optimizer step: DP rank 0's copy is broadcast, as DDP does, so an eval forward on any rank and the
checkpoint (which saves rank 0's) see the same values. Non-persistent buffers are left alone.
``full_state_dict(rank0_only=True)`` gives DP rank 0 the full weights and every other rank nothing."""

import pytest
import torch
import torch.distributed as dist
from torch import nn

import hybrid
from hybrid.local_launch import run_local

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
