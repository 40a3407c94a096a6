"""Optimizers, parameter groups, LR schedules and optimizer offload on real gloo ranks (world 2).

``ParityNet`` (sizes not divisible by DP, frozen, tied and sometimes-unused parameters, accumulation 2, a
clip in every step) is trained by the engine and, single-process, by the torch class itself on the same
global batches with the engine's default parameter groups (``param_groups.torch_param_groups``: no weight
decay on biases, norms and the embedding) and, with a schedule, a ``LambdaLR`` of the same rates:

* SGD with momentum and Adam (L2 decay) at every stage: fp32 losses, norms and weights
  within 1e-5 of torch;
* AdamW with ``param_groups`` (an ``lr_scale``) and a warmup + cosine schedule (stage 2): the same, and
  the learning rate of every step equal to torch's scheduler;
* optimizer offload (``offload_optimizer: {device: cpu}``) at stages 1-3: losses and weights
  bit-identical to the same stage without offload, within 1e-5 of torch AdamW, ``memory_report()`` moving
  the optimizer bytes into ``host``; bf16 with offload equal to bf16 without;
* a checkpoint saved mid-schedule with offload and resumed without it (SGD-momentum, stage 2), and the
  reverse (AdamW with groups and the cosine schedule, stage 3): the rest of the run bit-identical to the
  uninterrupted one, learning rates included.
"""

import tempfile

import pytest
import torch
import torch.distributed as dist

import hybrid
from hybrid import checkpoint
from hybrid.runtime.local_launch import run_local
from tests.dist.zero_models import ACCUM, STEPS, ParityNet, batch, config, rank_rows, reference, uses_aux

pytestmark = pytest.mark.slow

SGD = {"type": "SGD", "params": {"lr": 5e-2, "momentum": 0.9, "weight_decay": 0.01}}
ADAM_L2 = {"type": "Adam", "params": {"lr": 1e-2, "betas": [0.9, 0.95], "weight_decay": 0.1, "adam_w_mode": False}}
GROUPS = {"type": "AdamW", "params": {"lr": 2e-2, "betas": [0.9, 0.95], "weight_decay": 0.1},
          "param_groups": [{"names": ["blocks.0.*"], "lr_scale": 0.5}]}
COSINE = {"type": "WarmupCosineLR", "params": {"warmup_num_steps": 3, "total_num_steps": STEPS,
                                                "warmup_type": "linear", "cos_min_ratio": 0.1}}
CPU = {"offload_optimizer": {"device": "cpu", "pin_memory": True}}


def _cfg(stage, optimizer=None, scheduler=None, precision="fp32", **zero):
    d = config(stage, precision, **zero)
    if optimizer is not None:
        d["optimizer"] = optimizer
    if scheduler is not None:
        d["scheduler"] = scheduler
    return d


CASES = {f"stage{s}-{name}": _cfg(s, opt) for s in range(4) for name, opt in (("sgd", SGD), ("adam-l2", ADAM_L2))}
CASES.update({"stage2-groups-cosine": _cfg(2, GROUPS, COSINE)})
CASES.update({f"stage{s}-adamw": _cfg(s) for s in (1, 2, 3)})
CASES.update({f"stage{s}-adamw-offload": _cfg(s, **CPU) for s in (1, 2, 3)})
CASES.update({"stage3-bf16": _cfg(3, precision="bf16"), "stage3-bf16-offload": _cfg(3, precision="bf16", **CPU)})


def _cases(names):
    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    for name in names:
        engine = hybrid.initialize(ParityNet(), CASES[name])
        losses, lrs = [], []
        for step in range(STEPS):  # train_engine's schedule, with the lr of every step recorded
            losses += _one_step(engine, step, rank, world)
            lrs.append(engine.lr)
        out[name] = dict(losses=losses, lrs=lrs, memory=engine.memory_report(), state=engine.full_state_dict())
    return out


def _one_step(engine, step, rank, world):
    rows, losses = rank_rows(rank, world), []
    for micro in range(ACCUM):
        x, y = batch(step, micro)
        loss = engine(x[rows], y[rows], uses_aux(step, micro))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def _rel(actual, expected) -> float:
    a, e = torch.as_tensor(actual, dtype=torch.float64), torch.as_tensor(expected, dtype=torch.float64)
    return ((a - e).abs().max() / e.abs().max()).item()


def _mean_losses(runs):
    return [sum(r["losses"][i] for r in runs) / len(runs) for i in range(STEPS * ACCUM)]


def _resume(run_dir):
    """Save at step 4 under one layout, resume under another (offload flipped), finish; and uninterrupted."""
    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    for name, (first, second) in {"sgd": (_cfg(2, SGD, **CPU), _cfg(2, SGD)),
                                  "adamw-cosine": (_cfg(3, GROUPS, COSINE), _cfg(3, GROUPS, COSINE, **CPU))}.items():
        whole, whole_lrs = hybrid.initialize(ParityNet(), first), []
        for step in range(STEPS):
            _one_step(whole, step, rank, world)
            whole_lrs.append(whole.lr)
        a = hybrid.initialize(ParityNet(), first)
        for step in range(4):
            _one_step(a, step, rank, world)
        checkpoint.save(f"{run_dir}/{name}", a, 4)
        b = hybrid.initialize(ParityNet(), second)
        resumed = checkpoint.load(f"{run_dir}/{name}", b)
        lrs = []
        for step in range(resumed.step, STEPS):
            _one_step(b, step, rank, world)
            lrs.append(b.lr)
        out[name] = dict(whole=whole.full_state_dict(), resumed=b.full_state_dict(), lrs=(lrs, whole_lrs[4:]),
                         count=(b.optimizer_step_count, whole.optimizer_step_count))
    return out


def test_optimizers_groups_schedules_and_offload_world2():
    out = run_local(_cases, 2, list(CASES), timeout_s=300)
    refs = {}
    for name, d in CASES.items():
        runs = [r[name] for r in out]
        key = str(d.get("optimizer")) + str(d.get("scheduler"))
        if key not in refs:
            ref_lrs = []
            ref_losses, _, ref_state = reference(d, ref_lrs)
            refs[key] = ref_losses, ref_lrs, ref_state
        ref_losses, ref_lrs, ref_state = refs[key]
        bf16 = "bf16" in name
        assert _rel(_mean_losses(runs), ref_losses) < (2e-2 if bf16 else 1e-5), name
        assert runs[0]["lrs"] == pytest.approx(ref_lrs, rel=1e-12), f"{name}: lr per step"
        for key_, ref in ref_state.items():
            if not bf16:
                assert _rel(runs[0]["state"][key_], ref) < 1e-5, f"{name}: {key_}"
        offloaded = name.endswith("offload")
        for rank, run in enumerate(runs):
            host = run["memory"].get("host")
            assert (host is not None) == offloaded, name
            if offloaded:
                plain = out[rank][name[:-len("-offload")]]
                assert run["losses"] == plain["losses"], f"{name}: losses differ from no offload"
                assert all(torch.equal(run["state"][k], plain["state"][k]) for k in ref_state), name
                # fp32 without offload has no separate master (the parameters are it): half of AdamW's bytes
                plain_opt = plain["memory"]["optimizer"]
                assert run["memory"]["optimizer"] == 0, name
                assert host["optimizer"] == plain_opt + (0 if bf16 else plain_opt // 2), name
                assert host["grads"] > 0
    lrs = out[0]["stage2-groups-cosine"]["lrs"]
    assert lrs[0] == 0.0 and lrs[1] < lrs[2] < lrs[3] > lrs[-1], lrs  # warmup, then the cosine


def test_resume_mid_schedule_across_offload_is_bit_identical():
    with tempfile.TemporaryDirectory() as run_dir:
        out = run_local(_resume, 2, run_dir, timeout_s=300)
    for rank, res in enumerate(out):
        for name, r in res.items():
            assert r["count"][0] == r["count"][1] == STEPS, name
            assert r["lrs"][0] == r["lrs"][1], name
            for key, value in r["whole"].items():
                assert torch.equal(value, r["resumed"][key]), f"rank {rank} {name}: {key}"
