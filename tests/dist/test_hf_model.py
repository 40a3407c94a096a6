"""A Hugging Face model (keyword arguments in, a ``ModelOutput`` with ``.loss`` out) trained through
``engine(...)`` and ``hybrid.runtime.train.run_steps`` at ZeRO stages 0 and 3 on 2 real gloo ranks.

``GPT2LMHeadModel`` is built from a small ``GPT2Config`` (no download; ``transformers`` is a test extra):
its blocks sit in a ``ModuleList`` and its head is tied to the token embedding. ``batches(step)`` returns a
dict of keyword arguments (``input_ids``, ``labels``); the losses and final weights match the model trained
single-process with ``torch.optim.AdamW`` over the engine's default parameter groups (fp32, relative error < 1e-5).
"""

import pytest
import torch
import torch.distributed as dist

import hybrid
from hybrid.config.training import TrainConfig
from hybrid.zero.param_groups import torch_param_groups
from hybrid.runtime.local_launch import run_local
from hybrid.comm.mesh import build_mesh
from hybrid.runtime.train import Context, JobSettings, run_steps
from tests.dist.zero_models import BETAS, CLIP, LR, WEIGHT_DECAY, batch, config, rank_rows

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.slow

STEPS, VOCAB, SEQ = 4, 64, 12
EPS = 1e-4  # GPT-2's attention key bias has a zero exact gradient: Adam's eps keeps its rounding noise small


def _model():
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=SEQ,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False,
                                  bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(cfg)


def _ids(step: int) -> torch.Tensor:
    return batch(step, 0, vocab=VOCAB, seq=SEQ - 1)[0]


def _train_config(stage: int) -> dict:
    cfg = {**config(stage), "gradient_accumulation_steps": 1}
    cfg["optimizer"]["params"]["eps"] = EPS
    return cfg


def _rank(stages):
    mesh = build_mesh(tp=1)
    rows = rank_rows(mesh.dp_rank, mesh.dp)
    out = {}
    for stage in stages:
        engine = hybrid.initialize(_model(), _train_config(stage), dp_group=mesh.dp_group)
        losses = []
        settings = JobSettings(steps=STEPS, micro_batch=len(range(8)[rows]), stage=stage, precision="fp32")
        ctx = Context(mesh, {}, settings, rank=dist.get_rank(), world_size=dist.get_world_size(),
                      reporter=lambda r: losses.append(r["loss"]) if "loss" in r else None)
        summary = run_steps(ctx, engine, lambda step: {"input_ids": _ids(step)[rows], "labels": _ids(step)[rows]})
        out[stage] = dict(losses=losses, summary=summary, state=engine.full_state_dict(),
                          units=len(engine.gatherer.module_units) if engine.gatherer else 0,
                          on_demand=engine.gather_report()["on_demand"])
    return out


def _reference():
    model = _model()
    groups = torch_param_groups(model, TrainConfig.from_dict(_train_config(0)).optimizer)  # the engine's groups
    opt = torch.optim.AdamW(groups, lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY, foreach=False)
    losses = []
    for step in range(STEPS):
        loss = model(input_ids=_ids(step), labels=_ids(step)).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad(set_to_none=False)
        losses.append(loss.item())
    return losses, {n: t.detach().clone() for n, t in model.state_dict().items()}  # lm_head.weight tied: listed


def _rel(actual, expected) -> float:
    actual, expected = torch.as_tensor(actual, dtype=torch.float64), torch.as_tensor(expected, dtype=torch.float64)
    return ((actual - expected).abs().max() / expected.abs().max()).item()


def test_hugging_face_gpt2_through_run_steps():
    ref_losses, ref_state = _reference()
    out = run_local(_rank, 2, [0, 3], timeout_s=240)
    for stage in (0, 3):
        runs = [res[stage] for res in out]
        losses = [sum(r["losses"][i] for r in runs) / 2 for i in range(STEPS)]
        assert _rel(losses, ref_losses) < 1e-5, f"stage {stage}: {losses} vs {ref_losses}"
        for rank, run in enumerate(runs):
            assert run["summary"]["steps"] == STEPS
            assert run["state"].keys() == ref_state.keys(), "full_state_dict has state_dict()'s keys, tied ones too"
            _model().load_state_dict(run["state"], strict=True)
            for name, value in run["state"].items():
                assert _rel(value, ref_state[name]) < 1e-5, f"stage {stage} rank {rank}: {name}"
    assert out[0][3]["units"] == 1 + 2 and out[0][3]["on_demand"] == 0  # the rest + one per GPT2Block
