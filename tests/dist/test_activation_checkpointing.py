"""The built-in GPT with ``activation_checkpointing: true`` on 4 real gloo ranks, against itself without.

For TP 2 × DP 2 and TP 1 × DP 4 and every ZeRO stage 0-3, three steps with and without activation
checkpointing give the same losses and consolidated weights (fp32, relative error < 1e-6). At stage 3 the
recomputation in backward gathers nothing again: the DP all-gather bytes and counts per step and the
number of prefetches are equal with and without it, and equal to forward + backward gathers of every
non-persistent unit (2Ψ) plus the persistent unit's post-step refresh.

The same world measures the built-in GPT at 4 layers (stage 3, no persistent parameters): all-gathers
per step under the ``auto`` unit policy (one unit per block plus the rest: 2 × 5) against ``module`` (one
per module: 56), and the auto policy's traffic against stage 0 (1.5x within 1 %).
"""

import dataclasses
from pathlib import Path

import pytest
import torch

import hybrid
from hybrid.config.training import TrainConfig
from hybrid.runtime.local_launch import run_local
from hybrid.comm.mesh import build_mesh
from hybrid.models import GPT, GPTConfig

pytestmark = pytest.mark.slow

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "gpt-tiny.yaml"
MESHES = [(2, 2), (1, 4)]  # (tp, dp)
STEPS, GLOBAL_BATCH = 3, 8


def _train_config(stage: int, **zero) -> TrainConfig:
    return TrainConfig.from_dict({
        "zero": {"stage": stage, "reduce_bucket_size": 20_000, "allgather_bucket_size": 20_000,
                 "prefetch_bucket_size": 200_000, "param_persistence_threshold": 100, **zero},
        "precision": "fp32", "optimizer": {"lr": 1e-2, "eps": 1e-4}, "gradient_clipping": 0.3})


def _batch(step: int, cfg: GPTConfig) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + step)
    start = torch.randint(0, cfg.vocab_size, (GLOBAL_BATCH, 1), generator=g)
    stride = torch.randint(1, 4, (GLOBAL_BATCH, 1), generator=g)
    return (start + stride * torch.arange(cfg.seq_len + 1)) % cfg.vocab_size


def _train(cfg, mesh, config, steps=STEPS):
    engine = hybrid.initialize(GPT(cfg, tp_comm=mesh.tp_comm, device="meta"), config, dp_group=mesh.dp_group,
                               tp_group=mesh.tp_group)
    micro = GLOBAL_BATCH // mesh.dp
    rows = slice(mesh.dp_rank * micro, (mesh.dp_rank + 1) * micro)
    losses = []
    for step in range(steps):
        engine.reset_comm()  # the counters below are the last step's
        seq = _batch(step, cfg)[rows]
        loss = engine(seq[:, :-1], seq[:, 1:])
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return engine, losses


def _rank_runs():
    base = GPTConfig.from_yaml(CONFIG)
    out = {}
    for tp, dp in MESHES:
        mesh = build_mesh(tp=tp, dp=dp)
        for stage in range(4):
            for ac in (False, True):
                cfg = dataclasses.replace(base, activation_checkpointing=ac)
                engine, losses = _train(cfg, mesh, _train_config(stage))
                traffic, gathers = engine.comm_report(), engine.gather_report()  # before full_state_dict's
                state = engine.full_state_dict()
                persistent = sum(engine.layout.units[u].numel for u in engine.persistent_units)
                out[(tp, dp, stage, ac)] = dict(losses=losses, state=state, traffic=traffic, gathers=gathers,
                                                psi_bytes=4 * engine.layout.full_numel,
                                                persistent_bytes=4 * persistent)
    mesh = build_mesh(tp=1, dp=4)
    four = dataclasses.replace(base, n_layers=4)
    for name, stage, unit in (("stage0", 0, "auto"), ("auto", 3, "auto"), ("module", 3, "module")):
        engine, _ = _train(four, mesh, _train_config(stage, param_persistence_threshold=0, stage3_unit=unit), 2)
        out[name] = dict(traffic=engine.comm_report(), gathers=engine.gather_report())
    return out


def _rel(actual, expected) -> float:
    actual, expected = torch.as_tensor(actual), torch.as_tensor(expected)
    return ((actual - expected).abs().max() / expected.abs().max()).item()


def test_activation_checkpointing_same_results_same_gathers():
    out = run_local(_rank_runs, 4, timeout_s=300)
    for rank, res in enumerate(out):
        for tp, dp in MESHES:
            for stage in range(4):
                case = f"rank {rank} tp={tp} dp={dp} stage={stage}"
                plain, ac = res[(tp, dp, stage, False)], res[(tp, dp, stage, True)]
                assert _rel(ac["losses"], plain["losses"]) < 1e-6, f"{case}: {ac['losses']} vs {plain['losses']}"
                for name, value in plain["state"].items():
                    assert _rel(ac["state"][name], value) < 1e-6, f"{case}: {name}"
                assert ac["traffic"] == plain["traffic"], f"{case}: {ac['traffic']} vs {plain['traffic']}"
                assert ac["gathers"] == plain["gathers"], f"{case}: {ac['gathers']} vs {plain['gathers']}"
                if stage == 3:
                    sharded = plain["psi_bytes"] - plain["persistent_bytes"]
                    assert plain["traffic"]["all_gather"] == 2 * sharded + plain["persistent_bytes"], case
                    assert plain["gathers"]["prefetches"] > 0 and plain["gathers"]["on_demand"] == 0, case
        # GPT, 4 layers, stage 3 without persistent parameters: one unit per block plus the rest.
        auto, module = res["auto"], res["module"]
        assert auto["traffic"]["all_gather_calls"] == 2 * (4 + 1) == auto["gathers"]["gathers"], auto
        assert module["traffic"]["all_gather_calls"] == 56, module
        ratio = auto["traffic"]["total"] / res["stage0"]["traffic"]["total"]
        assert abs(ratio - 1.5) < 0.015, f"stage 3 (auto) / stage 0 traffic = {ratio:.5f}"
