"""hybrid.zero.optimizer: the flat, piecewise AdamW equals torch.optim.AdamW / Adam step for step."""

import pytest
import torch

from hybrid.config import OptimizerConfig
from hybrid.zero.optimizer import Segment, ShardedAdamW


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("decoupled", [True, False])
def test_piecewise_flat_adamw_matches_torch(decoupled, fused):
    torch.manual_seed(0)
    shapes = [(7, 5), (13,), (3, 3, 3)]
    ref = [torch.nn.Parameter(torch.randn(s)) for s in shapes]
    hyper = OptimizerConfig(lr=3e-2, betas=(0.8, 0.95), eps=1e-7, weight_decay=0.1, decoupled_weight_decay=decoupled)
    cls = torch.optim.AdamW if decoupled else torch.optim.Adam
    opt = cls(ref, lr=hyper.lr, betas=hyper.betas, eps=hyper.eps, weight_decay=hyper.weight_decay,
              **({"fused": True} if fused else {"foreach": False}))

    n = sum(p.numel() for p in ref)
    master = torch.cat([p.detach().reshape(-1) for p in ref]).clone()
    grad = torch.zeros(n)
    # Two segments at odd offsets, stepped in pieces of 4 elements.
    segments = [Segment(master[:30], grad[:30], 0, None), Segment(master[30:], grad[30:], 30, None)]
    flat = ShardedAdamW(segments, n, "cpu", hyper, sub_group_size=4, fused=fused)
    for step in range(5):
        grads = [torch.randn(s) for s in shapes]
        for p, g in zip(ref, grads):
            p.grad = g.clone()
        grad.copy_(torch.cat([g.reshape(-1) for g in grads]))
        scale = torch.tensor(0.5) if step % 2 else None
        if scale is not None:
            for p in ref:
                p.grad.mul_(scale)
        opt.step()
        flat.step(scale)
        expected = torch.cat([p.detach().reshape(-1) for p in ref])
        if fused:
            # The vectorized kernel rounds a tail differently from a full vector, so pieces cost a last bit.
            torch.testing.assert_close(master, expected, rtol=1e-6, atol=1e-7)
        else:
            assert torch.equal(master, expected), (master - expected).abs().max()
    assert flat.step_count == 5
    exp_avg = torch.cat([opt.state[p]["exp_avg"].reshape(-1) for p in ref])
    torch.testing.assert_close(flat.exp_avg, exp_avg, rtol=1e-6, atol=1e-8)


def test_bf16_segments_receive_the_updated_master():
    master = torch.randn(10)
    out = torch.zeros(10, dtype=torch.bfloat16)
    grad = torch.randn(10).to(torch.bfloat16)
    flat = ShardedAdamW([Segment(master, grad, 0, out)], 10, "cpu", OptimizerConfig(lr=0.1), sub_group_size=3)
    flat.step()
    assert torch.equal(out, master.to(torch.bfloat16))
