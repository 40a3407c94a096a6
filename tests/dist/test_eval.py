"""Held-out evaluation (``eval:``) on 4 real gloo ranks against the single-process GPT.

The built-in entrypoint ``hybrid.models.gpt:train`` trains a tiny GPT for 3 steps on a token file with
``eval: {fraction: 0.25, every: 2, batches: 2}`` at DP 4 stage 3, TP 2 x DP 2 stage 3 and TP 2 x DP 2 stage 1
(stage 3 with a persistence threshold that shards every matrix, so the evaluation's forward gathers units).
Checked in each case:

- the ranks report ``eval_loss`` after steps 2 and 3 (every 2, and always the last) and after no other, the same
  on every rank, with ``eval_ppl`` its exponential;
- that loss is the single-process GPT's (the weights ``full_state_dict()`` gave after that step, loaded into an
  unsplit GPT here) mean loss over the same held-out global batches: the last quarter of the file's windows,
  served by ``hybrid.runtime.evaluate.split_held_out`` (fp32, relative error < 1e-6);
- one more evaluation after the last step (``Evaluation.run``, from an ``after_step`` hook) gives the reported
  last loss again and leaves the ``full_state_dict()`` weights, each shard's master weights and optimizer
  states, the optimizer's step count, the learning rate and the gradients (None) bit-identical; at stage 3 it
  leaves no unit gathered (every non-persistent parameter released, as before it).

All cases share one spawned world of 4 ranks; the references run here, in the test process.
"""

import math

import numpy as np
import pytest
import torch
import torch.distributed as dist

from hybrid.comm.mesh import build_mesh
from hybrid.data import TokenFile, TokenFileMeta, metadata_path
from hybrid.models import GPT, GPTConfig
from hybrid.runtime.local_launch import run_local
from hybrid.runtime.train import Context, JobSettings

pytestmark = pytest.mark.slow

MODEL = {"vocab_size": 64, "seq_len": 16, "n_layers": 2, "hidden": 32, "n_heads": 4}
ZERO = {"param_persistence_threshold": 64, "reduce_bucket_size": 4096, "prefetch_bucket_size": 4096}
CASES = [(1, 4, 3), (2, 2, 3), (2, 2, 1)]  # (tp, dp, stage)
STEPS, MICRO, SEED = 3, 2, 5
EVAL = {"fraction": 0.25, "every": 2, "batches": 2}


def _token_file(path) -> None:
    """A learnable file: tokens of a random chain with 2 successors each."""
    rng = np.random.default_rng(0)
    successors = rng.integers(0, MODEL["vocab_size"], (MODEL["vocab_size"], 2))
    tokens = np.empty(4000, dtype="<u2")
    tokens[0] = 0
    for i in range(1, len(tokens)):
        tokens[i] = successors[tokens[i - 1], rng.integers(0, 2)]
    tokens.tofile(path)
    metadata_path(path).write_text(TokenFileMeta("uint16", MODEL["vocab_size"], len(tokens)).to_json())


def _snapshot(engine) -> dict:
    """Everything an evaluation must leave alone (a collective: full_state_dict)."""
    views = engine.shard_views()
    return {"weights": engine.full_state_dict(),
            "shards": {n: (v.master.clone(), {k: s.clone() for k, s in v.states.items()}) for n, v in views.items()},
            "step_count": engine.optimizer_step_count, "lr": engine.lr,
            "grads": [p.grad for p in engine.module.parameters()]}


def _same(a: dict, b: dict) -> bool:
    weights = a["weights"].keys() == b["weights"].keys() and all(
        torch.equal(t, b["weights"][n]) for n, t in a["weights"].items())
    shards = a["shards"].keys() == b["shards"].keys() and all(
        torch.equal(m, b["shards"][n][0]) and all(torch.equal(s, b["shards"][n][1][k]) for k, s in st.items())
        for n, (m, st) in a["shards"].items())
    return (weights and shards and a["step_count"] == b["step_count"] and a["lr"] == b["lr"]
            and all(g is None for g in a["grads"] + b["grads"]))


def _gathered(engine) -> list:
    """The non-persistent units gathered now (stage 3; none below it)."""
    g = engine.gatherer
    if g is None:
        return []
    return g.gathered_units()


def _rank_cases(path):
    from hybrid.models.gpt import train
    from hybrid.runtime.evaluate import Evaluation, split_held_out, stream_eval_batches

    rank = dist.get_rank()
    out = {}
    for tp, dp, stage in CASES:
        mesh = build_mesh(tp=tp, dp=dp)
        reports, weights, extra = [], {}, {}

        def hook(ctx, engine, step):
            if step in (2, STEPS):
                weights[step] = engine.full_state_dict(rank0_only=True)
            if step != STEPS:
                return
            _, held = split_held_out(TokenFile(path, MODEL["seq_len"], SEED), EVAL["fraction"])
            again = Evaluation(stream_eval_batches(ctx, held, MICRO, EVAL["batches"]), EVAL["batches"])
            gathered_before = _gathered(engine)
            before = _snapshot(engine)
            extra["eval"] = again.run(ctx, engine)
            after = _snapshot(engine)
            extra.update(same=_same(before, after), gathered=(gathered_before, _gathered(engine)),
                         released=sum(p.data.numel() == 0 for p in engine.module.parameters()))

        model_config = {"model": MODEL, "data": str(path), "zero": ZERO, "eval": EVAL}
        ctx = Context(mesh, model_config, JobSettings(steps=STEPS, micro_batch=MICRO, stage=stage, precision="fp32",
                                                      seed=SEED), rank=rank, world_size=4, reporter=reports.append)
        summary = train(ctx, after_step=[hook])
        evals = {r["step"]: (r["eval_loss"], r["eval_ppl"]) for r in reports if "eval_loss" in r}
        out[(tp, dp, stage)] = dict(evals=evals, steps=sorted(r["step"] for r in reports if "loss" in r),
                                    weights=weights if rank == 0 else None, summary_eval=summary["eval_loss"],
                                    **extra)
    return out


def _held_out_loss(path, weights: dict, dp: int) -> float:
    from hybrid.runtime.evaluate import split_held_out

    model = GPT(GPTConfig.from_dict(MODEL), seed=SEED)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(weights[name])
        _, held = split_held_out(TokenFile(path, MODEL["seq_len"], SEED), EVAL["fraction"])
        # DP rank r's rows of held-out batch i are rows r*MICRO... of the global batch of MICRO*dp rows
        losses = [model(*held.batch(i, MICRO * dp, 0, 1)).item() for i in range(EVAL["batches"])]
    return sum(losses) / len(losses)


def _rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


def test_eval_matches_single_process_and_leaves_the_state_alone(tmp_path):
    path = tmp_path / "tokens.bin"
    _token_file(path)
    out = run_local(_rank_cases, 4, path, timeout_s=240)
    for tp, dp, stage in CASES:
        case = f"tp={tp} dp={dp} stage={stage}"
        per_rank = [res[(tp, dp, stage)] for res in out]
        first = per_rank[0]
        assert first["steps"] == [1, 2, 3], case
        assert sorted(first["evals"]) == [2, 3], f"{case}: evaluated after steps {sorted(first['evals'])}"
        for res in per_rank:
            assert res["evals"] == first["evals"], f"{case}: the ranks disagree on the eval loss"
            assert res["same"], f"{case}: an evaluation changed the weights or the optimizer state"
            assert res["eval"]["eval_loss"] == first["evals"][STEPS][0], f"{case}: a second evaluation differs"
            assert res["summary_eval"] == first["evals"][STEPS][0], case
            if stage == 3:
                assert res["gathered"] == ([], []), f"{case}: units left gathered {res['gathered']}"
                assert res["released"] > 0, f"{case}: no parameter is sharded, so nothing was gathered"
        for step, (loss, ppl) in first["evals"].items():
            assert ppl == pytest.approx(math.exp(loss), rel=1e-12), case
            expected = _held_out_loss(path, first["weights"][step], dp)
            assert _rel(loss, expected) < 1e-6, f"{case} step {step}: eval loss {loss} vs single-process {expected}"
