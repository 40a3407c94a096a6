"""Pure pieces of tensor parallelism: slicing rules, seeded layout-independent init, mesh degrees, the loss at tp 1."""

import pytest
import torch
import torch.nn.functional as F

from hybrid.errors import ConfigError
from hybrid.comm.mesh import mesh_degrees
from hybrid.weights.attrs import mark_tensor_parallel
from hybrid.tp import vocab_parallel_cross_entropy
from hybrid.weights.init import Normal, set_initializer
from hybrid.tp.sharding import init_param_, tp_slice
from hybrid.weights.attrs import full_shape


@pytest.mark.parametrize("dim", [0, 1])
def test_seeded_slices_concatenate_to_the_full_draw(dim):
    tp = 4
    full = set_initializer(torch.nn.Parameter(torch.empty(8, 12)), Normal(std=0.02))
    init_param_(full, seed=7, name="w", tp_rank=0, tp=1)
    slices = []
    for rank in range(tp):
        shape = [8, 12]
        shape[dim] //= tp
        p = mark_tensor_parallel(torch.nn.Parameter(torch.empty(shape)), dim)
        set_initializer(p, Normal(std=0.02))
        assert full_shape(p, tp) == torch.Size([8, 12])
        init_param_(p, seed=7, name="w", tp_rank=rank, tp=tp)
        assert torch.equal(p, tp_slice(full.detach(), dim, rank, tp))
        slices.append(p.detach())
    assert torch.equal(torch.cat(slices, dim=dim), full.detach())


def test_values_depend_on_seed_and_name():
    def draw(seed, name):
        p = set_initializer(torch.nn.Parameter(torch.empty(4)), Normal(std=1.0))
        init_param_(p, seed=seed, name=name, tp_rank=0, tp=1)
        return p.detach()

    assert torch.equal(draw(1, "a"), draw(1, "a"))
    assert not torch.equal(draw(1, "a"), draw(2, "a"))
    assert not torch.equal(draw(1, "a"), draw(1, "b"))


def test_replicated_tensors_are_not_sliced():
    t = torch.arange(6.0)
    assert tp_slice(t, None, 1, 2) is t


@pytest.mark.parametrize("world, tp, dp, expected", [(4, 2, None, (2, 2)), (4, 4, None, (1, 4)),
                                                     (4, 1, 4, (4, 1)), (1, 1, None, (1, 1))])
def test_mesh_degrees(world, tp, dp, expected):
    assert mesh_degrees(world, tp, dp) == expected


@pytest.mark.parametrize("world, tp, dp, match", [
    (4, 3, None, "tp=3 does not divide the world size 4"),
    (4, 2, 3, r"tp=2 × dp=3 = 6 ranks but the world size is 4"),
    (4, 0, None, "tp must be a positive integer"),
    (4, 2, 0, "dp must be a positive integer"),
])
def test_mesh_degrees_errors(world, tp, dp, match):
    with pytest.raises(ConfigError, match=match):
        mesh_degrees(world, tp, dp)


def test_vocab_parallel_cross_entropy_at_tp1_is_cross_entropy():
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(10, 16, generator=g) * 30).requires_grad_()  # large logits: stability matters
    targets = torch.randint(0, 16, (10,), generator=g)
    weights = torch.rand(10, generator=g)
    loss = vocab_parallel_cross_entropy(logits, targets)
    (loss * weights).sum().backward()
    ref_logits = logits.detach().clone().requires_grad_()
    ref = F.cross_entropy(ref_logits, targets, reduction="none")
    (ref * weights).sum().backward()
    torch.testing.assert_close(loss, ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(logits.grad, ref_logits.grad, rtol=1e-6, atol=1e-6)


def test_a_negative_partition_dim_is_stored_as_the_dimension_it_names():
    import torch
    from hybrid.weights.attrs import mark_tensor_parallel, tensor_parallel_dim
    from hybrid.weights.init import Normal, local_values

    p = mark_tensor_parallel(torch.nn.Parameter(torch.empty(6, 4)), -1)
    assert tensor_parallel_dim(p) == 1
    full = local_values(Normal(), 3, "w", (6, 8), None, 0, 1, 0, 48).view(6, 8)
    for rank in range(2):  # the slices along -1 are those along 1
        piece = local_values(Normal(), 3, "w", (6, 8), tensor_parallel_dim(p), rank, 2, 0, 24).view(6, 4)
        assert torch.equal(piece, full.chunk(2, 1)[rank])
    with pytest.raises(ValueError, match="partition_dim 2 is not a dimension of a 2-D parameter"):
        mark_tensor_parallel(torch.nn.Parameter(torch.empty(6, 4)), 2)
