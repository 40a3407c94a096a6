"""Tensor parallelism on real gloo ranks: each TP layer, the GPT, the mesh and its errors at TP 2.

One spawned world of 2 ranks runs every check and returns, per check, the max error relative to the
reference's largest magnitude; the assertions happen here so a failure names the check.
"""

import pytest
import torch

from hybrid.errors import ConfigError
from hybrid.weights.attrs import tensor_parallel_dim
from hybrid.runtime.local_launch import run_local
from hybrid.comm.mesh import build_mesh
from hybrid.models import GPT, GPTConfig
from hybrid.tp import (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding, gather_tp_state_dict,
                       tp_slice, vocab_parallel_cross_entropy)

pytestmark = pytest.mark.slow

TINY = dict(vocab_size=256, seq_len=32, n_layers=2, hidden=64, n_heads=4)


def _err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    return ((actual - expected).abs().max() / expected.abs().max().clamp_min(1e-30)).item()


def _randn(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _linear_checks(comm, rank, tp):
    errs = {}
    x_full = _randn(3, 5, 16, seed=1)
    for gather in (False, True):
        ref = ColumnParallelLinear(16, 24, tp_comm=None, seed=11)
        layer = ColumnParallelLinear(16, 24, tp_comm=comm, gather_output=gather, seed=11)
        g_out = _randn(3, 5, 24, seed=2)
        x_ref, x = x_full.clone().requires_grad_(), x_full.clone().requires_grad_()
        y_ref, y = ref(x_ref), layer(x)
        (y_ref * g_out).sum().backward()
        (y * (g_out if gather else tp_slice(g_out, -1, rank, tp))).sum().backward()
        name = f"column(gather_output={gather})"
        errs[f"{name} out"] = _err(y, y_ref if gather else tp_slice(y_ref, -1, rank, tp))
        errs[f"{name} dx"] = _err(x.grad, x_ref.grad)
        errs[f"{name} dW"] = _err(layer.weight.grad, tp_slice(ref.weight.grad, 0, rank, tp))
        errs[f"{name} db"] = _err(layer.bias.grad, tp_slice(ref.bias.grad, 0, rank, tp))

    for parallel_input in (True, False):
        ref = RowParallelLinear(16, 24, tp_comm=None, seed=12)
        layer = RowParallelLinear(16, 24, tp_comm=comm, input_is_parallel=parallel_input, seed=12)
        with torch.no_grad():  # a non-zero bias, to check it is added once after the reduce
            ref.bias.copy_(_randn(24, seed=3))
            layer.bias.copy_(ref.bias)
        g_out = _randn(3, 5, 24, seed=4)
        x_ref = x_full.clone().requires_grad_()
        x = (tp_slice(x_full, -1, rank, tp) if parallel_input else x_full).clone().requires_grad_()
        y_ref, y = ref(x_ref), layer(x)
        (y_ref * g_out).sum().backward()
        (y * g_out).sum().backward()
        name = f"row(input_is_parallel={parallel_input})"
        errs[f"{name} out"] = _err(y, y_ref)
        errs[f"{name} dx"] = _err(x.grad, tp_slice(x_ref.grad, -1, rank, tp) if parallel_input else x_ref.grad)
        errs[f"{name} dW"] = _err(layer.weight.grad, tp_slice(ref.weight.grad, 1, rank, tp))
        errs[f"{name} db"] = _err(layer.bias.grad, ref.bias.grad)
    return errs


def _embedding_and_loss_checks(comm, rank, tp):
    errs = {}
    ids = torch.randint(0, 32, (3, 7), generator=torch.Generator().manual_seed(5))
    ref = VocabParallelEmbedding(32, 8, tp_comm=None, seed=13)
    layer = VocabParallelEmbedding(32, 8, tp_comm=comm, seed=13)
    g_out = _randn(3, 7, 8, seed=6)
    (ref(ids) * g_out).sum().backward()
    y = layer(ids)
    (y * g_out).sum().backward()
    errs["embedding out"] = _err(y, ref(ids))
    errs["embedding dW"] = _err(layer.weight.grad, tp_slice(ref.weight.grad, 0, rank, tp))

    logits_full = _randn(21, 32, seed=7) * 20
    targets = torch.randint(0, 32, (21,), generator=torch.Generator().manual_seed(8))
    targets[::4] = -100  # F.cross_entropy's ignore_index: loss 0, no gradient
    weights = _randn(21, seed=9)
    ref_logits = logits_full.clone().requires_grad_()
    ref_loss = torch.nn.functional.cross_entropy(ref_logits, targets, reduction="none")
    (ref_loss * weights).sum().backward()
    local = tp_slice(logits_full, -1, rank, tp).clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(local, targets, comm)
    (loss * weights).sum().backward()
    errs["vocab CE loss"] = _err(loss, ref_loss)
    errs["vocab CE dlogits"] = _err(local.grad, tp_slice(ref_logits.grad, -1, rank, tp))
    for what, call in (("input", lambda: layer(torch.tensor([[3, 32]]))),
                       ("target", lambda: vocab_parallel_cross_entropy(local, torch.tensor([0] * 20 + [32]), comm))):
        try:
            call()
            errs[f"exact {what} id 32 refused"] = 1.0
        except IndexError as exc:
            errs[f"exact {what} id 32 refused"] = float(f"{what} id 32 is outside the vocabulary [0, 32)" not in str(exc))
    return errs


def _gpt_checks(comm):
    errs = {}
    cfg = GPTConfig(**TINY)
    ref, model = GPT(cfg, seed=5), GPT(cfg, tp_comm=comm, seed=5)
    init = gather_tp_state_dict(dict(model.named_parameters()), model, comm)
    errs["gpt init (exact)"] = max(_err(init[n], p.detach()) for n, p in ref.named_parameters())

    g = torch.Generator().manual_seed(10)
    idx = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len), generator=g)
    targets = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len), generator=g)
    ref_loss, loss = ref(idx, targets), model(idx, targets)
    ref_loss.backward()
    loss.backward()
    errs["gpt loss"] = _err(loss.detach(), ref_loss.detach())
    kept = targets.clone()
    kept[:, ::3] = -100
    with torch.no_grad():
        expected = torch.nn.functional.cross_entropy(ref(idx).reshape(-1, cfg.vocab_size), kept.reshape(-1))
        errs["gpt loss ignore_index"] = _err(model(idx, kept), expected)
    grads = gather_tp_state_dict({n: p.grad for n, p in model.named_parameters()}, model, comm)
    for name, p in ref.named_parameters():
        errs[f"gpt grad {name}"] = _err(grads[name], p.grad)
    with torch.no_grad():
        errs["gpt logits"] = _err(model(idx), ref(idx))
    name = "blocks.0.attn.qkv.weight"
    errs["full_to_tp_slice"] = _err(model.full_to_tp_slice(name, ref.get_parameter(name).detach()),
                                    model.get_parameter(name).detach())
    return errs


def _torch_rng_build(comm):
    torch.manual_seed(7)
    return [ColumnParallelLinear(16, 24, tp_comm=comm), ColumnParallelLinear(16, 24, tp_comm=comm),
            RowParallelLinear(24, 16, tp_comm=comm), VocabParallelEmbedding(32, 8, tp_comm=comm)]


def _torch_rng_checks(comm, rank):
    """Default-built layers draw from torch's generator like nn.Linear (two layers differ) and, seeded alike,
    hold the slices of the single-process layers' tensors."""
    full, local = _torch_rng_build(None), _torch_rng_build(comm)
    errs = {}
    for i, (ref, layer) in enumerate(zip(full, local)):
        for name, p in layer.named_parameters():
            dim = tensor_parallel_dim(p)
            errs[f"exact torch-rng init {i}.{name}"] = _err(p, tp_slice(getattr(ref, name), dim, rank, 2))
    errs["exact torch-rng layers differ"] = float(torch.equal(full[0].weight, full[1].weight))
    return errs


def _tp2_world():
    rank = torch.distributed.get_rank()
    mesh = build_mesh(tp=2)
    facts = dict(dp=mesh.dp, tp=mesh.tp, dp_rank=mesh.dp_rank, tp_rank=mesh.tp_rank,
                 node_index=mesh.node_index, local_rank=mesh.local_rank, dims=mesh.device_mesh.mesh_dim_names)
    comm = mesh.tp_comm
    errs = {**_linear_checks(comm, rank, 2), **_embedding_and_loss_checks(comm, rank, 2), **_gpt_checks(comm),
            **_torch_rng_checks(comm, rank)}
    traffic = dict(tp=comm.report(), dp=mesh.dp_comm.report())

    # Row-parallel forward: exactly one all-reduce of the (3, 24) fp32 output.
    comm.reset()
    RowParallelLinear(16, 24, tp_comm=comm, seed=0)(torch.ones(3, 8))
    row_forward = comm.report()

    errors = {}
    for name, call in [
        ("world", lambda: build_mesh(tp=3)),
        ("heads", lambda: GPT(GPTConfig(**{**TINY, "n_heads": 1}), tp_comm=comm)),
        ("vocab", lambda: GPT(GPTConfig(**{**TINY, "vocab_size": 255}), tp_comm=comm)),
    ]:
        try:
            call()
        except ConfigError as exc:
            errors[name] = str(exc)
    import hybrid

    for name, model, group in (("no tp_group", GPT(GPTConfig(**TINY), tp_comm=comm), None),
                               ("tp_group, plain model", GPT(GPTConfig(**TINY)), mesh.tp_group),
                               ("tp_group, no TP layers", torch.nn.Linear(4, 4), mesh.tp_group)):
        try:
            hybrid.initialize(model, {"zero_optimization": {"stage": 1}}, dp_group=mesh.dp_group, tp_group=group)
        except ValueError as exc:
            errors[name] = str(exc)
    # reduce_from_tp_region on a caller's tensor leaves it as it was (it used to be summed in place, and a
    # tensor autograd had saved then failed backward with a version error)
    from hybrid.tp import reduce_from_tp_region

    w = torch.full((3,), float(rank + 1), requires_grad=True)
    h = w * 1.0
    aux = (h * h).sum()
    total = reduce_from_tp_region(h, comm)
    (aux + total.sum()).backward()
    reduce_kept = (h.tolist(), total.tolist(), w.grad.tolist())

    # logits that are not even V/tp slices: one sentence on every rank, not a hang or a silently wrong loss
    targets = torch.tensor([0, 3])
    for name, logits, vocab in (("uneven", torch.randn(2, 5 - rank), None),  # 9 entries split 5/4 by hand
                                ("full logits", torch.randn(2, 8), 8)):      # a plain head on every rank
        try:
            vocab_parallel_cross_entropy(logits, targets, comm, vocab_size=vocab)
        except ValueError as exc:
            errors[name] = str(exc)
    return dict(facts=facts, errs=errs, traffic=traffic, row_forward=row_forward, errors=errors,
                reduce_kept=reduce_kept)


def test_tp2_layers_gpt_and_mesh():
    out = run_local(_tp2_world, 2)
    for rank, res in enumerate(out):
        assert res["facts"] == dict(dp=1, tp=2, dp_rank=0, tp_rank=rank, node_index=0, local_rank=rank,
                                    dims=("dp", "tp"))
        for name, err in res["errs"].items():
            limit = 0.0 if "exact" in name else (1e-5 if name.startswith("gpt") else 1e-6)
            assert err <= limit, f"rank {rank}: {name} relative error {err:.3g} > {limit}"
        assert res["traffic"]["dp"]["total"] == 0, "TP traffic leaked into the DP counter"
        assert res["traffic"]["tp"]["all_reduce"] > 0 and res["traffic"]["tp"]["all_gather"] > 0
        assert res["row_forward"]["all_reduce"] == 2 * 3 * 24 * 4 and res["row_forward"]["total"] == 2 * 3 * 24 * 4
        assert res["errors"]["world"] == ("tp=3 does not divide the world size 2; choose a tp that divides 2.")
        assert res["errors"]["heads"].startswith("model.n_heads=1 is not divisible by the tensor-parallel degree tp=2")
        assert res["errors"]["vocab"].startswith("model.vocab_size=255 is not divisible")
        # the engine's tp_group must be the one the model's TP layers are split over (else: silently wrong)
        assert res["errors"]["no tp_group"].startswith(
            "tok_emb is a VocabParallelEmbedding split over a TP group of size 2, but hybrid.initialize got no "
            "tp_group"), res["errors"]
        assert "split over a TP group of size 1, but hybrid.initialize got a tp_group of size 2" in \
            res["errors"]["tp_group, plain model"]
        assert "the model has no tensor-parallel parameters" in res["errors"]["tp_group, no TP layers"]
        assert res["reduce_kept"] == ([rank + 1.0] * 3, [3.0] * 3, [2.0 * (rank + 1) + 1] * 3)
        assert res["errors"]["uneven"].startswith("vocab_parallel_cross_entropy: the TP ranks hold logits of 4 to "
                                                  "5 vocabulary entries; each must hold an equal V/tp slice")
        assert res["errors"]["full logits"].startswith("vocab_parallel_cross_entropy: logits of 8 entries on each "
                                                       "of 2 TP rank(s) are not a vocabulary of 8")


def _mesh_warnings(ranks_per_node):
    import logging
    import os

    os.environ["LOCAL_WORLD_SIZE"] = str(ranks_per_node)  # as torchrun says it on a multi-node job
    seen = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())
    logging.getLogger("hybrid.comm.mesh").addHandler(handler)
    build_mesh(tp=2)
    return seen


@pytest.mark.parametrize("ranks_per_node, spanning", [(2, None), (4, None), (1, "[0, 1] on nodes [0, 1] (2 TP"),
                                                      (3, "[2, 3] on nodes [0, 1] (1 TP")])
def test_build_mesh_warns_when_a_tp_group_spans_nodes(ranks_per_node, spanning):
    out = run_local(_mesh_warnings, 4, ranks_per_node, timeout_s=60)
    assert [bool(w) for w in out] == [spanning is not None, False, False, False]  # rank 0 says it, once
    if spanning:
        assert f"tp=2 puts TP group ranks {spanning} group(s) span nodes)" in out[0][0], out[0]
