"""hybrid.zero.optimizer: any elementwise torch.optim class over flat pieces equals that class on the tensors;
hybrid.zero.param_groups: the default groups; hybrid.config.schedule: DeepSpeed's schedules equal torch schedulers and
DeepSpeed's published definitions (values worked out by hand at known steps)."""

import math

import re

import pytest
import torch

from hybrid.config.training import OptimizerConfig, SchedulerConfig, TrainConfig
from hybrid.errors import ConfigError
from hybrid.config.schedule import lr_at
from hybrid.zero.optimizer import FlatOptimizer, Piece, probe_state
from hybrid.zero.param_groups import Group, assign, embedding_names, torch_param_groups

SHAPES = [(7, 5), (13,), (3, 3, 3)]
CASES = {
    "adamw": OptimizerConfig(lr=3e-2, betas=(0.8, 0.95), eps=1e-7, weight_decay=0.1),
    "adam-l2": OptimizerConfig(lr=3e-2, betas=(0.8, 0.95), eps=1e-7, weight_decay=0.1, decoupled_weight_decay=False),
    "sgd-momentum": OptimizerConfig(type="SGD", lr=5e-2, weight_decay=0.01, extra=(("momentum", 0.9),)),
    "sgd-nesterov": OptimizerConfig(type="SGD", lr=5e-2, extra=(("momentum", 0.8), ("nesterov", True))),
    "rmsprop": OptimizerConfig(type="RMSprop", lr=1e-2, extra=(("momentum", 0.5),)),
}


def _flat(cfg, impl, sub_group_size=4, groups=None, group_of=None):
    n = sum(math.prod(s) for s in SHAPES)
    master, grad = torch.randn(n), torch.zeros(n)
    group_of = group_of or [0, 0, 0]
    starts = [0, 35, 48]
    # pieces at odd offsets, cut again by sub_group_size
    pieces = [Piece(master[a:a + math.prod(s)], grad[a:a + math.prod(s)], a, None, group_of[k])
              for k, (a, s) in enumerate(zip(starts, SHAPES))]
    cfg = OptimizerConfig(**{**cfg.__dict__, "implementation": impl})
    return FlatOptimizer(pieces, n, "cpu", cfg, sub_group_size, groups or [Group(cfg.weight_decay)]), master, grad


@pytest.mark.parametrize("impl", ["for-loop", "fused", "foreach"])
@pytest.mark.parametrize("name", list(CASES))
def test_flat_pieces_match_torch(name, impl):
    torch.manual_seed(0)
    cfg = CASES[name]
    flat, master, grad = _flat(cfg, impl)
    ref = [torch.nn.Parameter(t.detach().clone().view(s)) for t, s in
           zip(torch.split(master, [math.prod(s) for s in SHAPES]), SHAPES)]
    kw = {"foreach": False} if impl == "for-loop" else {"foreach": True} if impl == "foreach" else {}
    if impl == "fused" and flat.fused:
        kw = {"fused": True}
    opt = cfg.torch_class(ref, **cfg.torch_kwargs(), **kw)
    for step in range(5):
        grads = [torch.randn(s) for s in SHAPES]
        scale = torch.tensor(0.5) if step % 2 else None
        for p, g in zip(ref, grads):
            p.grad = g.clone() if scale is None else g * scale
        grad.copy_(torch.cat([g.reshape(-1) for g in grads]))
        opt.step()
        flat.step([cfg.lr], scale)
        expected = torch.cat([p.detach().reshape(-1) for p in ref])
        if impl == "for-loop":
            assert torch.equal(master, expected), (master - expected).abs().max()
        else:  # a vectorized kernel rounds a tail differently from a full vector: a last bit
            torch.testing.assert_close(master, expected, rtol=1e-6, atol=1e-7)
    assert flat.step_count == 5
    for key in flat.keys:
        expected = torch.cat([opt.state[p][key].reshape(-1) for p in ref])
        torch.testing.assert_close(flat.buffers[key], expected, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("name", ["adamw", "sgd-momentum"])
def test_restored_state_continues_bit_for_bit(name):
    torch.manual_seed(1)
    cfg = CASES[name]
    a, master_a, grad_a = _flat(cfg, "for-loop")
    grads = [torch.randn(master_a.numel()) for _ in range(6)]
    for g in grads[:3]:
        grad_a.copy_(g)
        a.step([cfg.lr])
    b, master_b, grad_b = _flat(cfg, "for-loop", sub_group_size=7)  # another cut of the same shard
    master_b.copy_(master_a)
    for key in a.keys:
        b.buffers[key].copy_(a.buffers[key])
    b.restore(a.step_count)
    for g in grads[3:]:
        grad_a.copy_(g)
        grad_b.copy_(g)
        a.step([cfg.lr])
        b.step([cfg.lr])
    assert torch.equal(master_a, master_b)


def test_sub_group_size_bounds_each_batch_and_bf16_out_receives_the_master():
    master, out = torch.randn(10), torch.zeros(10, dtype=torch.bfloat16)
    grad = torch.randn(10).to(torch.bfloat16)
    flat = FlatOptimizer([Piece(master, grad, 0, out)], 10, "cpu", OptimizerConfig(lr=0.1), 3)
    assert [sum(hi - lo for _, _, lo, hi in b.views) for b in flat.batches] == [3, 3, 3, 1]
    flat.step([0.1])
    assert torch.equal(out, master.to(torch.bfloat16))


def test_one_batch_steps_every_group_in_one_optimizer():
    flat, _, _ = _flat(CASES["adamw"], "fused", sub_group_size=10**9, groups=[Group(0.1), Group(0.0, 2.0)],
                       group_of=[0, 1, 0])
    assert len(flat.batches) == 1
    assert [g["weight_decay"] for g in flat.batches[0].opt.param_groups] == [0.1, 0.0]


def test_state_probe():
    assert probe_state(torch.optim.AdamW, {"lr": 1e-3}) == (("exp_avg", "exp_avg_sq"), torch.float32)
    assert probe_state(torch.optim.SGD, {"lr": 1e-3, "momentum": 0.9}) == (("momentum_buffer",), None)
    with pytest.raises(ConfigError, match="ASGD keeps state"):
        probe_state(torch.optim.ASGD, {"lr": 1e-3})


def test_a_tied_embedding_weight_is_exempt_whichever_module_is_declared_first():
    class HeadFirst(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.head = torch.nn.Linear(4, 5, bias=False)
            self.emb = torch.nn.Embedding(5, 4)
            self.head.weight = self.emb.weight

    model = HeadFirst()
    assert [n for n, _ in model.named_parameters()] == ["head.weight"]  # the tied weight's first name
    assert embedding_names(model) == {"head.weight"}
    of, groups = assign(["head.weight"], [(5, 4)], embedding_names(model), OptimizerConfig(weight_decay=0.1))
    assert groups[of[0]].weight_decay == 0.0


def test_default_groups_exempt_biases_norms_and_embeddings():
    model = torch.nn.Sequential(torch.nn.Embedding(5, 4), torch.nn.LayerNorm(4), torch.nn.Linear(4, 3))
    names = [n for n, _ in model.named_parameters()]
    shapes = [tuple(p.shape) for _, p in model.named_parameters()]
    cfg = OptimizerConfig(weight_decay=0.1)
    of, groups = assign(names, shapes, embedding_names(model), cfg)
    assert {n: groups[g].weight_decay for n, g in zip(names, of)} == {
        "0.weight": 0.0, "1.weight": 0.0, "1.bias": 0.0, "2.weight": 0.1, "2.bias": 0.0}
    of, groups = assign(names, shapes, set(), OptimizerConfig(weight_decay=0.1, no_decay="none"))
    assert len(groups) == 1 and groups[0].weight_decay == 0.1
    custom = TrainConfig.from_dict({"optimizer": {"weight_decay": 0.1, "no_decay": ["*.bias"], "param_groups": [
        {"names": ["0.*"], "lr_scale": 0.5}]}}).optimizer
    of, groups = assign(names, shapes, embedding_names(model), custom)
    assert [groups[g] for g in of] == [Group(0.1, 0.5), Group(0.1), Group(0.0), Group(0.1), Group(0.0)]
    ref = torch_param_groups(model, custom)
    assert [(len(g["params"]), g["weight_decay"], g["lr"]) for g in ref] == [(1, 0.1, 5e-4), (2, 0.1, 1e-3),
                                                                             (2, 0.0, 1e-3)]
    typo = TrainConfig.from_dict({"optimizer": {"param_groups": [{"names": ["0.*"], "lr_scale": 0.5},
                                                                  {"names": ["head.*"], "lr_scale": 0.1}]}})
    with pytest.raises(ConfigError, match=r"^optimizer.param_groups\[1\].names \['head.\*'\] match no trainable "
                                          r"parameter \(names look like '2.weight', '2.bias'"):
        assign(names, shapes, set(), typo.optimizer)  # it would silently change nothing
    shadowed = TrainConfig.from_dict({"optimizer": {"param_groups": [{"names": ["*"], "lr_scale": 0.5},
                                                                      {"names": ["2.*"], "lr_scale": 0.1}]}})
    with pytest.raises(ConfigError, match=r"^optimizer.param_groups\[1\].names \['2.\*'\] match only parameters "
                                          r"an earlier entry already takes"):
        assign(names, shapes, set(), shadowed.optimizer)
    for no_decay in ("all", ["*.bias", "*.bais"]):  # a word taken for a mode, a typo: every decay would stay
        mistyped = TrainConfig.from_dict({"optimizer": {"weight_decay": 0.1, "no_decay": no_decay}})
        wrong = "all" if no_decay == "all" else "*.bais"
        with pytest.raises(ConfigError, match=rf"^optimizer.no_decay pattern '{re.escape(wrong)}' matches no "
                                              r"trainable parameter \(names look like '2.weight', '2.bias'"):
            assign(names, shapes, set(), mistyped.optimizer)


def _torch_lrs(make, steps, lr=0.1):
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)
    sched = make(opt)
    out = []
    for _ in range(steps):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return out


def test_schedules_equal_torch_schedulers():
    S = torch.optim.lr_scheduler
    warm, total, base = 5, 20, 0.1
    # linear warmup from 0 + linear decay to 0 == SequentialLR(LinearLR, LinearLR)
    decay = SchedulerConfig("WarmupDecayLR", (("warmup_min_lr", 0.0), ("warmup_num_steps", warm),
                                              ("total_num_steps", total), ("warmup_type", "linear")))
    expected = _torch_lrs(lambda o: S.SequentialLR(o, [S.LinearLR(o, 1e-12, 1.0, warm),
                                                       S.LinearLR(o, 1.0, 0.0, total - warm)], [warm]), total)
    ours = [lr_at("WarmupDecayLR", decay.values, base, i, base) for i in range(total)]
    assert ours == pytest.approx(expected, rel=1e-12, abs=1e-12)
    # a group with lr_scale 2 gets twice the rate
    wl = SchedulerConfig("WarmupLR", (("warmup_num_steps", 4),)).values
    assert [lr_at("WarmupLR", wl, 2 * base, i, base) for i in range(6)] == pytest.approx(
        [2 * lr_at("WarmupLR", wl, base, i, base) for i in range(6)])


# DeepSpeed's published definitions (deepspeed/runtime/lr_schedules.py, WarmupLR / WarmupDecayLR /
# WarmupCosineLR), as a function of the scheduler's last_batch_iteration i -- our lr_at(..., i, ...):
#   WarmupLR:       lr = min_lr + (max_lr - min_lr) * gamma(i), n = max(2, warmup_num_steps),
#                   gamma = log(i + 1) / log(n) ('log') or i / n ('linear') while i < n, then 1
#   WarmupDecayLR:  the same gamma while i < n, then max(0, (total - i) / max(1, total - n))
#   WarmupCosineLR: ratio of each group's lr: warmup_min_ratio + (1 - warmup_min_ratio) * gamma(i) while i < n,
#                   then max(0, cos_min + (1 - cos_min) * (1 + cos(pi * p)) / 2) with
#                   p = min(1, (i - n + 1) / max(1, total - n)) (held at cos_min_ratio once the schedule ends)
# The values below were worked out from those formulas by hand (not by our code), each with its arithmetic.
DEEPSPEED_VALUES = [
    # WarmupLR, log warmup, min 0.01, max 0.1, n 10
    ("WarmupLR", {"warmup_min_lr": 0.01, "warmup_max_lr": 0.1, "warmup_num_steps": 10}, [
        (0, 0.01),                        # log(1) = 0: the minimum
        (1, 0.0370926996097583),          # 0.01 + 0.09 * log(2) / log(10)
        (4, 0.07290730039024168),         # 0.01 + 0.09 * log(5) / log(10)
        (9, 0.1),                         # log(10) / log(10) = 1
        (50, 0.1)]),                      # past the warmup: the maximum
    # WarmupLR, linear warmup, min 0, max = optimizer.lr 0.1 (DeepSpeed: the optimizer's lr when not given), n 4
    ("WarmupLR", {"warmup_num_steps": 4, "warmup_type": "linear"}, [
        (0, 0.0), (1, 0.025), (3, 0.075), (4, 0.1)]),  # 0.1 * i / 4, then 0.1
    # WarmupDecayLR, log warmup, min 0.001, max 0.1, n 5, total 20
    ("WarmupDecayLR", {"warmup_min_lr": 0.001, "warmup_max_lr": 0.1, "warmup_num_steps": 5, "total_num_steps": 20}, [
        (0, 0.001),                       # gamma 0
        (2, 0.06857801325411256),         # 0.001 + 0.099 * log(3) / log(5)
        (4, 0.1),                         # log(5) / log(5) = 1
        (5, 0.1),                         # (20 - 5) / 15 = 1
        (10, 0.067),                      # 0.001 + 0.099 * 10 / 15
        (19, 0.0076),                     # 0.001 + 0.099 * 1 / 15
        (20, 0.001),                      # (20 - 20) / 15 = 0: the minimum
        (25, 0.001)]),                    # max(0, -5 / 15) = 0: stays at the minimum
    # WarmupCosineLR, linear warmup, warmup_min_ratio 0.1, cos_min_ratio 0.01, n 5, total 20, group lr 0.1
    ("WarmupCosineLR", {"warmup_num_steps": 5, "total_num_steps": 20, "warmup_type": "linear",
                        "warmup_min_ratio": 0.1, "cos_min_ratio": 0.01}, [
        (0, 0.01),                        # 0.1 * (0.1 + 0.9 * 0 / 5)
        (2, 0.046),                       # 0.1 * (0.1 + 0.9 * 2 / 5)
        (4, 0.082),                       # 0.1 * (0.1 + 0.9 * 4 / 5)
        (5, 0.09891830623632339),         # 0.1 * (0.01 + 0.99 * (1 + cos(pi * 1 / 15)) / 2)
        (12, 0.04532584106825116),        # 0.1 * (0.01 + 0.99 * (1 + cos(pi * 8 / 15)) / 2)
        (18, 0.0020816937636766184),      # 0.1 * (0.01 + 0.99 * (1 + cos(pi * 14 / 15)) / 2)
        (19, 0.001),                      # cos(pi) = -1: 0.1 * cos_min_ratio
        (30, 0.001)]),                    # past total_num_steps: p is held at 1, the rate does not rise again
    # WarmupCosineLR with DeepSpeed's default log warmup, warmup_min_ratio 0
    ("WarmupCosineLR", {"warmup_num_steps": 5, "total_num_steps": 20}, [
        (0, 0.0),                         # log(1) = 0
        (1, 0.0430676558073393),          # 0.1 * log(2) / log(5)
        (3, 0.0861353116146786)]),        # 0.1 * log(4) / log(5)
]


@pytest.mark.parametrize("kind, params, expected", DEEPSPEED_VALUES,
                         ids=[f"{k}-{i}" for i, (k, _, _) in enumerate(DEEPSPEED_VALUES)])
def test_schedules_give_deepspeeds_published_values(kind, params, expected):
    values = SchedulerConfig(kind, tuple(params.items())).values
    got = [(i, lr_at(kind, values, 0.1, i, 0.1)) for i, _ in expected]
    assert got == [(i, pytest.approx(lr, rel=1e-12, abs=1e-15)) for i, lr in expected]
