"""A stop request that reaches the ranks at different moments stops them all before the same step.

The driver asks every rank actor to stop (Ctrl-C, a resize at a checkpoint); each rank sees its own flag when the
request arrives, so one rank may see it a step before another. ``run_steps`` checks ``Context.stop_agreed`` (one
all-reduce of the flags over every rank) before each step: here rank 0's flag rises after step 2 and rank 1's never
does, and both stop after step 2 -- without the agreement rank 1 would start step 3 alone and wait in its
gradient reduction until the collective timed out.
"""

import pytest
import torch

from hybrid.runtime.local_launch import run_local

pytestmark = pytest.mark.slow

STEPS, STOP_AFTER = 6, 2


def _rank() -> dict:
    import torch.distributed as dist

    import hybrid
    from hybrid.comm.mesh import build_mesh
    from hybrid.config.training import TrainConfig, ZeroConfig
    from hybrid.runtime.train import Context, JobSettings, run_steps

    mesh = build_mesh(tp=1)
    rank = dist.get_rank()
    ctx = Context(mesh, {}, JobSettings(steps=STEPS, micro_batch=2, stage=1), rank=rank,
                  world_size=dist.get_world_size(), reporter=lambda record: None,
                  stop_requested=lambda: rank == 0 and ctx.step >= STOP_AFTER)
    engine = hybrid.initialize(_Summed(), TrainConfig(zero=ZeroConfig(stage=1), precision="fp32"),
                               dp_group=mesh.dp_group)
    g = torch.Generator().manual_seed(rank)
    summary = run_steps(ctx, engine, lambda step: torch.randn(2, 4, generator=g))
    return {"steps": summary["steps"], "flag": ctx.should_stop()}


class _Summed(torch.nn.Module):
    """A linear layer whose forward returns its summed output: the loss ``train_step`` back-propagates."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 1)

    def forward(self, x):
        return self.linear(x).sum()


def test_a_stop_seen_by_one_rank_stops_every_rank_before_the_same_step():
    results = run_local(_rank, 2, timeout_s=120)
    assert [r["steps"] for r in results] == [STOP_AFTER, STOP_AFTER]
    assert [r["flag"] for r in results] == [True, False]  # rank 1 never saw a request of its own
