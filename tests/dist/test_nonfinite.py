"""The non-finite guard on real gloo ranks: a NaN gradient on one rank skips that step on every rank.

World 2 (DP 2), ``ParityNet`` at every ZeRO stage with gradient accumulation: the input of one micro-step
on rank 1 is made NaN (a forward pre-hook), so that rank's gradients -- and through the reduction and the
global norm every rank's -- are NaN. Every rank skips the step, and the final weights, Adam moments and
optimizer step count equal (bit for bit) those of a run that never saw that batch. Stage 1 with
``max_nonfinite_skips: 2`` and two poisoned steps in a row fails on every rank with the same one-sentence
``NonFiniteError``. TP 2 (gpt-tiny): a NaN only in a TP-replicated parameter's gradient on one TP rank
still makes both TP ranks skip (the replicated sum is not all-reduced over TP, its NaN must still spread).
"""

import pytest
import torch

import hybrid
from hybrid.errors import NonFiniteError
from hybrid.runtime.local_launch import run_local
from hybrid.comm.mesh import build_mesh
from hybrid.models import GPT, GPTConfig
from hybrid.weights.attrs import is_tensor_parallel
from hybrid.zero.clip import NonFiniteGuard
from tests.dist.zero_models import ACCUM, ParityNet, batch, config, rank_rows, uses_aux

STEPS, POISONED = 5, 2  # the step whose batch rank 1 poisons (or the reference never sees)


def _engine(stage: int, **extra):
    mesh = build_mesh(tp=1, dp=2)
    model = ParityNet()
    engine = hybrid.initialize(model, {**config(stage), **extra}, dp_group=mesh.dp_group)
    poison = {"on": False}
    model.blocks[0].register_forward_pre_hook(
        lambda module, args: (args[0] * float("nan"),) if poison["on"] else None)
    return mesh, engine, poison


def _train(mesh, engine, poison, steps, poisoned=()) -> list:
    """Train on ``steps`` (data step indices); rank 1 poisons micro-step 0 of each step in ``poisoned``.
    Returns what each engine.step() at an accumulation boundary returned."""
    rows = rank_rows(mesh.dp_rank, mesh.dp)
    stepped = []
    for step in steps:
        for micro in range(ACCUM):
            poison["on"] = step in poisoned and micro == 0 and mesh.dp_rank == 1
            x, y = batch(step, micro)
            engine.backward(engine(x[rows], y[rows], uses_aux(step, micro)))
            done = engine.step()
            if micro == ACCUM - 1:
                stepped.append(done)
    poison["on"] = False
    return stepped


def _state(engine) -> dict:
    views = {n: (v.master.clone(), v.exp_avg.clone(), v.exp_avg_sq.clone())
             for n, v in engine.shard_views().items()}
    return {"full": {n: t.numpy() for n, t in engine.full_state_dict().items()},
            "views": {n: [t.numpy() for t in ts] for n, ts in views.items()},
            "optimizer_steps": engine.optimizer_step_count, "global_step": engine.global_step}


def _same(a: dict, b: dict) -> bool:
    arrays = lambda s: [*s["full"].values(), *(t for ts in s["views"].values() for t in ts)]  # noqa: E731
    return (a["optimizer_steps"], a["global_step"], list(a["full"]), list(a["views"])) == \
        (b["optimizer_steps"], b["global_step"], list(b["full"]), list(b["views"])) and \
        all(x.tobytes() == y.tobytes() for x, y in zip(arrays(a), arrays(b), strict=True))


def _tp_replicated_nan() -> dict:
    """gpt-tiny at TP 2 (DP 1, stage 0): only TP rank 1's gradient of one replicated parameter is NaN."""
    mesh = build_mesh(tp=2, dp=1)
    cfg = GPTConfig.from_yaml("configs/gpt-tiny.yaml")
    model = GPT(cfg, tp_comm=mesh.tp_comm, seed=0)
    engine = hybrid.initialize(model, config(0), dp_group=mesh.dp_group, tp_group=mesh.tp_group)
    name, param = next((n, p) for n, p in model.named_parameters() if not is_tensor_parallel(p))
    poison = {"on": False}
    param.register_hook(lambda g: torch.full_like(g, float("nan")) if poison["on"] else g)
    g = torch.Generator().manual_seed(5)
    seq = torch.randint(0, cfg.vocab_size, (4, cfg.seq_len + 1), generator=g)
    norms = []
    for micro in range(ACCUM):
        poison["on"] = micro == 0 and mesh.tp_rank == 1
        engine.backward(engine(seq[:, :-1], seq[:, 1:]))
        engine.step()
    norms.append(engine.last_grad_norm)
    return {"param": name, "skipped": engine.nonfinite.skipped, "optimizer_steps": engine.optimizer_step_count,
            "norm_finite": [n == n for n in norms]}


def _ranks() -> dict:
    out = {}
    for stage in range(4):
        mesh, engine, poison = _engine(stage)
        stepped = _train(mesh, engine, poison, range(STEPS), poisoned={POISONED})
        poisoned = {"stepped": stepped, "skipped": engine.nonfinite.skipped, "state": _state(engine)}
        mesh, engine, poison = _engine(stage)
        _train(mesh, engine, poison, [s for s in range(STEPS) if s != POISONED])
        out[stage] = {**poisoned, "reference": _state(engine)}

    mesh, engine, poison = _engine(1, max_nonfinite_skips=2)
    try:
        _train(mesh, engine, poison, range(STEPS), poisoned={1, 3, 4})  # 1 alone is skipped; 3, 4 fail
        out["fails"] = None
    except NonFiniteError as err:
        out["fails"] = (str(err), engine.nonfinite.skipped, engine.optimizer_step_count)
    out["tp"] = _tp_replicated_nan()
    return out


@pytest.mark.slow
def test_a_nan_gradient_on_one_rank_skips_the_step_on_every_rank():
    ranks = run_local(_ranks, 2, timeout_s=240)
    for rank, got in enumerate(ranks):
        for stage in range(4):
            run = got[stage]
            assert run["stepped"] == [s != POISONED for s in range(STEPS)], (rank, stage)
            assert run["skipped"] == 1
            assert run["state"]["optimizer_steps"] == STEPS - 1
            assert _same(run["state"], run["reference"]), f"stage {stage}, rank {rank}: not the batch-less run"

        message, skipped, steps = got["fails"]
        assert (skipped, steps) == (3, 2)  # steps 0 and 2 were taken; 1, 3 and 4 skipped, failing at 4
        assert "2 consecutive steps" in message and "max_nonfinite_skips = 2" in message and "\n" not in message
        assert message == ranks[0]["fails"][0]

        tp = got["tp"]
        assert (tp["skipped"], tp["optimizer_steps"], tp["norm_finite"]) == (1, 0, [False]), (rank, tp)


def test_the_guard_counts_consecutive_non_finite_norms():
    guard = NonFiniteGuard(3)
    assert [guard.skip(n) for n in (1.0, float("nan"), float("inf"), 2.0, float("nan"))] == \
        [False, True, True, False, True]
    assert (guard.skipped, guard.consecutive) == (3, 1)
    guard.skip(float("-inf"))
    with pytest.raises(NonFiniteError, match="3 consecutive steps"):
        guard.skip(float("nan"))
    with pytest.raises(NonFiniteError):
        NonFiniteGuard(1).skip(float("nan"))
    assert NonFiniteGuard(1).skip(0.0) is False


def test_max_nonfinite_skips_is_a_checked_config_field():
    from hybrid.config.training import TrainConfig
    from hybrid.errors import ConfigError

    assert TrainConfig().max_nonfinite_skips == 5
    assert TrainConfig.from_dict({"max_nonfinite_skips": 2}).max_nonfinite_skips == 2
    for bad in (0, -1, 1.5, "3", True):
        with pytest.raises(ConfigError, match="max_nonfinite_skips must be a positive integer"):
            TrainConfig.from_dict({"max_nonfinite_skips": bad})
