"""ZeRO × TP on 4 real gloo ranks against single-process torch AdamW.

For TP 2 × DP 2, TP 4 × DP 1 and TP 1 × DP 4, and every ZeRO stage 0–3: 10 steps of gpt-tiny on the
same global batches give the same losses, pre-clip gradient norms and ``full_state_dict()`` weights (full
tensors at every TP degree; with ``rank0_only`` on global rank 0 alone) as the
single-process model trained with ``torch.optim.AdamW`` and ``clip_grad_norm_`` (fp32, relative error
< 1e-5). The clip value is below every step's gradient norm, so clipping is active in every step and a
norm that counted TP-replicated parameters t times would show up in the norms and the weights.

Every rank builds the GPT on the meta device (the engine materializes its shard), the reference the
ordinary way. All twelve runs share one spawned world of 4 ranks; the reference runs here, in the test process.
"""

from pathlib import Path

import pytest
import torch

from hybrid.config.training import OptimizerConfig
from hybrid.zero.param_groups import torch_param_groups  # the engine's default groups

import hybrid
from hybrid.config.training import TrainConfig
from hybrid.runtime.local_launch import run_local
from hybrid.comm.mesh import build_mesh
from hybrid.models import GPT, GPTConfig
from hybrid.weights.attrs import is_tensor_parallel

pytestmark = pytest.mark.slow

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "gpt-tiny.yaml"
MESHES = [(2, 2), (4, 1), (1, 4)]  # (tp, dp)
STAGES = [0, 1, 2, 3]
STEPS, GLOBAL_BATCH, SEED = 10, 8, 0
# Adam divides by sqrt(v) + eps, so a gradient element near fp32 rounding noise (e.g. the attention key
# bias, whose exact gradient is 0 because softmax is shift-invariant) gets an update of ~lr·noise/eps: with
# eps=1e-8, reordered sums alone move weights by ~1e-4 relative in any two correct runs. eps=1e-4 keeps
# that noise near 1e-6, so the comparison checks the plumbing rather than rounding.
LR, BETAS, EPS, WEIGHT_DECAY, CLIP = 1e-2, (0.9, 0.95), 1e-4, 0.1, 0.3


def _train_config(stage: int) -> TrainConfig:
    return TrainConfig.from_dict({
        "zero": {"stage": stage, "reduce_bucket_size": 20_000, "allgather_bucket_size": 20_000,
                 "prefetch_bucket_size": 20_000, "param_persistence_threshold": 100},
        "precision": "fp32",
        "optimizer": {"lr": LR, "betas": list(BETAS), "eps": EPS, "weight_decay": WEIGHT_DECAY},
        "gradient_clipping": CLIP,
    })


def _batch(step: int, seq_len: int, vocab: int) -> torch.Tensor:
    """Arithmetic sequences mod vocab: learnable, so the weights move in a way that matters."""
    g = torch.Generator().manual_seed(1000 + step)
    start = torch.randint(0, vocab, (GLOBAL_BATCH, 1), generator=g)
    stride = torch.randint(1, 4, (GLOBAL_BATCH, 1), generator=g)
    return (start + stride * torch.arange(seq_len + 1)) % vocab


def _reference(cfg: GPTConfig):
    model = GPT(cfg, seed=SEED)
    opt = torch.optim.AdamW(torch_param_groups(model, OptimizerConfig(lr=LR, weight_decay=WEIGHT_DECAY)), lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY)
    losses, norms, replicated_sq = [], [], []
    for step in range(STEPS):
        seq = _batch(step, cfg.seq_len, cfg.vocab_size)
        loss = model(seq[:, :-1], seq[:, 1:])
        loss.backward()
        replicated_sq.append(sum(p.grad.pow(2).sum().item() for p in model.parameters()
                                 if not is_tensor_parallel(p)))
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP).item())
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, norms, replicated_sq, {n: p.detach().clone() for n, p in model.named_parameters()}


def _rank_runs():
    cfg = GPTConfig.from_yaml(CONFIG)
    rank = torch.distributed.get_rank()
    results = {}
    for tp, dp in MESHES:
        mesh = build_mesh(tp=tp, dp=dp)
        results[(tp, dp)] = dict(
            coords=(mesh.dp_rank, mesh.tp_rank, mesh.node_index, mesh.local_rank),
            tp_ranks=torch.distributed.get_process_group_ranks(mesh.tp_group),
            dp_ranks=torch.distributed.get_process_group_ranks(mesh.dp_group))
        micro = GLOBAL_BATCH // dp
        rows = slice(mesh.dp_rank * micro, (mesh.dp_rank + 1) * micro)
        for stage in STAGES:
            # Built on meta: the engine draws only what each rank keeps; the reference is built the ordinary way.
            model = GPT(cfg, tp_comm=mesh.tp_comm, device="meta")
            engine = hybrid.initialize(model, _train_config(stage), dp_group=mesh.dp_group,
                                       tp_group=mesh.tp_group, seed=SEED)
            losses, norms = [], []
            for step in range(STEPS):
                seq = _batch(step, cfg.seq_len, cfg.vocab_size)[rows]
                loss = engine(seq[:, :-1], seq[:, 1:])
                engine.backward(loss)
                assert engine.step(), "every step is an accumulation boundary here"
                losses.append(loss.item())
                norms.append(float(engine.last_grad_norm))
            full, only0 = engine.full_state_dict(), engine.full_state_dict(rank0_only=True)
            assert (only0.keys() == full.keys()) if rank == 0 else only0 == {}, (rank, tp, dp, stage)
            assert all(torch.equal(only0[n], t) for n, t in full.items()) if rank == 0 else True
            results[(tp, dp, stage)] = dict(losses=losses, norms=norms, weights=full if rank == 0 else None)
    return results


def _rel(actual, expected) -> float:
    actual, expected = torch.as_tensor(actual), torch.as_tensor(expected)
    return ((actual - expected).abs().max() / expected.abs().max()).item()


def test_zero_stages_times_tp_match_single_process_adamw():
    cfg = GPTConfig.from_yaml(CONFIG)
    ref_losses, ref_norms, replicated_sq, ref_weights = _reference(cfg)
    assert min(ref_norms) > CLIP, "the clip must trigger in every step"
    # Counting the TP-replicated parameters twice (TP 2) would move the norm far beyond the tolerance.
    for norm, rep in zip(ref_norms, replicated_sq):
        assert (norm ** 2 + rep) ** 0.5 / norm - 1 > 1e-3
    assert ref_losses[-1] < ref_losses[0] - 0.2, "the reference must learn, or the check is weak"

    out = run_local(_rank_runs, 4, timeout_s=240)
    for rank, res in enumerate(out):
        for tp, dp in MESHES:  # TP innermost: TP group k holds ranks k·tp … k·tp+tp−1
            node, local = rank // tp, rank % tp
            # run_local puts every rank on one node: node index 0, local rank = rank, whatever the tp
            assert res[(tp, dp)] == dict(coords=(node, local, 0, rank),
                                         tp_ranks=list(range(node * tp, node * tp + tp)),
                                         dp_ranks=list(range(local, 4, tp))), (rank, tp, dp)
    for tp, dp, stage in [(tp, dp, stage) for tp, dp in MESHES for stage in STAGES]:
        case = f"tp={tp} dp={dp} stage={stage}"
        per_rank = [res[(tp, dp, stage)] for res in out]
        # The loss of a DP rank is the mean over its micro-batch; the global loss is their mean.
        losses = [sum(r["losses"][s] for r in per_rank) / len(per_rank) for s in range(STEPS)]
        assert _rel(losses, ref_losses) < 1e-5, f"{case}: losses {losses} vs {ref_losses}"
        for rank, res in enumerate(per_rank):
            assert _rel(res["norms"], ref_norms) < 1e-5, f"{case} rank {rank}: norms {res['norms']} vs {ref_norms}"
        weights = per_rank[0]["weights"]
        assert weights.keys() == ref_weights.keys(), case
        for name, ref in ref_weights.items():
            err = _rel(weights[name], ref)
            assert err < 1e-5, f"{case}: {name} relative error {err:.3g}"


def _wrong_group_rank():
    from hybrid.errors import ConfigError

    cfg = GPTConfig.from_yaml(CONFIG)
    mesh = build_mesh(tp=2, dp=2)
    out = []
    for given in (mesh.dp_group, None):  # the right size but other ranks; none at all
        try:
            hybrid.initialize(GPT(cfg, tp_comm=mesh.tp_comm, device="meta"), _train_config(0),
                              dp_group=mesh.dp_group, tp_group=given, seed=SEED)
            out.append("accepted")
        except ConfigError as err:
            out.append(str(err))
    return out


def test_a_tp_group_of_other_ranks_than_the_models_is_refused():
    """A model split over mesh.tp_comm (ranks {0,1}) with tp_group=mesh.dp_group (ranks {0,2}, as many) trained
    on with the wrong slices: losses and weights off from the first step, without a word."""
    for rank, (other, none) in enumerate(run_local(_wrong_group_rank, 4)):
        assert "split over the ranks [" in other and "but hybrid.initialize got a tp_group of the ranks [" in other, other
        assert "got no tp_group (or one of size 1)" in none, none
