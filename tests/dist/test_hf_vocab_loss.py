"""Hugging Face causal LMs at TP 2 x DP 2 with their logits left split by vocabulary (``hybrid.tp.parallelize``:
a column-parallel head without the gather, the loss ``hybrid.tp.causal_lm_loss``) against single-process torch
AdamW on the unsplit model with transformers' own loss (fp32, relative error < 1e-5 on the losses and the final
weights; the clip active in every step).

Llama untied (ZeRO-1), Llama with its head tied to the vocab-split embedding (ZeRO-2), and Gemma 2 (a scaled
embedding tied to the head, soft-capped logits: ``tanh(z / c) · c`` applied to each rank's slice; ZeRO-3).

No rank holds a full-vocabulary logits tensor: a ``TorchDispatchMode`` around each forward and backward records
the widest last dimension of every tensor with one row per token (the logits' shape: ``b·s`` rows, or ``b × s``),
which is ``V/2`` with the split logits and ``V`` for the control, the same model split by its plan alone
(``apply_plan(model, hf_plan(model))``: the head's logits gathered); ``splits_logits(model, 2)``, the planner's
question, says which on every rank.

``hybrid.models.hf:train`` (2 steps of the Llama, ZeRO-1) takes the split logits too: its model's loss is the
vocab-parallel one, its widest such tensor ``V/2``. A Llama whose head scales each vocabulary entry after its
product (as Dory's does) keeps the gathered logits, and the plan's notes say why.
"""

import math

import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import hybrid
from hybrid.comm.mesh import build_mesh
from hybrid.runtime.local_launch import run_local
from hybrid.tp import apply_plan, hf_plan, parallelize, splits_logits
from hybrid.tp.plan import plan_notes
from tests.dist.test_hf_tp import (GLOBAL_BATCH, SEED, SEQ, STEPS, VOCAB, _build, _config, _ids, _reference, _rel,
                                   _train_config)

pytest.importorskip("transformers")
pytestmark = pytest.mark.slow

CASES = [("llama", 1, "split"), ("llama-tied", 2, "split"), ("gemma2", 3, "split"), ("llama", 0, "gathered")]


class WidestPerToken(TorchDispatchMode):
    """The widest last dimension of any tensor an op makes with ``tokens`` rows (the logits' shape)."""

    def __init__(self, tokens: int):
        super().__init__()
        self.tokens, self.widest = tokens, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.dim() >= 2 and math.prod(t.shape[:-1]) == self.tokens:
                self.widest = max(self.widest, t.shape[-1])
        return out


def _hf_train(mesh, config_path: str) -> dict:
    """``hybrid.models.hf:train`` at TP 2 x DP 2 for 2 steps: whether its model's loss was the vocab-parallel one,
    and the widest per-token tensor its steps made."""
    from hybrid.models.hf import train
    from hybrid.runtime.train import Context, JobSettings
    from hybrid.tp.hf_logits import uses_split_logits

    settings = JobSettings(steps=2, micro_batch=2, stage=1, precision="fp32")
    ctx = Context(mesh, {"hf": {"config": config_path, "seq_len": SEQ}, "train": {"lr": 0.01}}, settings,
                  rank=dist.get_rank(), world_size=dist.get_world_size())
    used = []
    widest = WidestPerToken(tokens=settings.micro_batch * (SEQ + 1))  # hf:train's rows: seq_len + 1 tokens
    with widest:
        summary = train(ctx, after_step=[lambda ctx, engine, step: used.append(uses_split_logits(engine.module))])
    return dict(used=used, widest=widest.widest, steps=summary["steps"])


class ScaledHead(torch.nn.Linear):
    """A head of its own that scales each vocabulary entry after its product (as Dory's does): not split."""

    def __init__(self, config):
        super().__init__(config.hidden_size, config.vocab_size, bias=False)
        self.scale = torch.nn.Parameter(torch.ones(config.vocab_size))

    def forward(self, x):
        return super().forward(x) * self.scale


def _fallback(mesh, rows) -> dict:
    """A Llama with a ``ScaledHead`` split by ``parallelize`` at TP 2: its logits gathered, the plan's notes say
    why; one step's widest per-token tensor and loss."""
    import transformers

    torch.manual_seed(SEED)  # built with values, each rank keeping its slice
    model = transformers.LlamaForCausalLM(_config("llama"))
    model.lm_head = ScaledHead(model.config)
    parallelize(model, mesh.tp_comm)
    engine = hybrid.initialize(model, _train_config(1), dp_group=mesh.dp_group, tp_group=mesh.tp_group, seed=SEED,
                               init_fn=model._init_weights)
    widest = WidestPerToken(tokens=(GLOBAL_BATCH // mesh.dp) * SEQ)
    with widest:
        loss = engine(input_ids=_ids(0)[rows], labels=_ids(0)[rows]).loss
        engine.backward(loss)
    return dict(notes=plan_notes(model), widest=widest.widest, loss=loss.item())


def _rank_runs(cases, config_path):
    mesh = build_mesh(tp=2)
    rows = slice(mesh.dp_rank * GLOBAL_BATCH // mesh.dp, (mesh.dp_rank + 1) * GLOBAL_BATCH // mesh.dp)
    out = {}
    for name, stage, logits in cases:
        model = _build(name, "meta")
        if logits == "split":
            parallelize(model, mesh.tp_comm)
        else:
            apply_plan(model, hf_plan(model), mesh.tp_comm)
        engine = hybrid.initialize(model, _train_config(stage), dp_group=mesh.dp_group, tp_group=mesh.tp_group,
                                   seed=SEED, init_fn=model._init_weights)
        widest = WidestPerToken(tokens=(GLOBAL_BATCH // mesh.dp) * SEQ)
        losses = []
        for step in range(STEPS):
            ids = _ids(step)[rows]
            with widest:
                loss = engine(input_ids=ids, labels=ids).loss
                engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        out[(name, stage, logits)] = dict(losses=losses, widest=widest.widest, notes=plan_notes(model),
                                          predicted=splits_logits(model, 2),
                                          weights=engine.full_state_dict(rank0_only=True))
    out["hf:train"] = _hf_train(mesh, config_path)
    out["fallback"] = _fallback(mesh, rows)
    return out


def test_split_logits_keep_parity_at_tp2_dp2_and_no_rank_holds_the_whole_vocabulary(tmp_path):
    references = {name: _reference(name, "meta") for name in {name for name, _, _ in CASES}}
    _config("llama").to_json_file(str(tmp_path / "config.json"))
    results = run_local(_rank_runs, 4, CASES, str(tmp_path / "config.json"), timeout_s=300)
    for rank, res in enumerate(results):  # hybrid.models.hf:train takes the split logits too
        assert res["hf:train"] == dict(used=[True, True], widest=VOCAB // 2, steps=2), (rank, res["hf:train"])
        fallback = res["fallback"]  # a forward that needs the whole vocabulary keeps the gathered logits
        assert fallback["widest"] == VOCAB and math.isfinite(fallback["loss"]), (rank, fallback)
        assert (f"logits gathered on every TP rank (its forward combines the logits with a tensor over the "
                f"vocabulary (mul with a tensor of shape ({VOCAB},)) before the loss)") in fallback["notes"], fallback
    for case in CASES:
        name, _, logits = case
        per_rank = [res[case] for res in results]
        ref_losses, ref_norms, ref_weights = references[name]
        assert min(ref_norms) > 0.3 and ref_losses[-1] < ref_losses[0], "the clip triggers and the reference learns"
        losses = [sum(r["losses"][s] for r in per_rank) / len(per_rank) for s in range(STEPS)]
        assert _rel(losses, ref_losses) < 1e-5, f"{case}: losses {losses} vs {ref_losses}"
        for key, ref in ref_weights.items():
            assert _rel(per_rank[0]["weights"][key], ref) < 1e-5, f"{case}: {key}"
        assert {r["predicted"] for r in per_rank} == {logits == "split"}, f"{case}: the planner's splits_logits"
        widths = {r["widest"] for r in per_rank}
        if logits == "split":
            assert widths == {VOCAB // 2}, f"{case}: a rank held logits {widths} wide (vocabulary {VOCAB})"
            assert "logits left split by vocabulary (a vocabulary-parallel loss)" in per_rank[0]["notes"], case
        else:  # the control: the gathered logits are seen, so the recorder would catch them
            assert widths == {VOCAB}, f"{case}: {widths}"
