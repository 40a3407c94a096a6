"""Hugging Face models split by their own TP plan against single-process torch AdamW.

Tiny random-init ``transformers`` models -- Llama with grouped-query attention (4 heads, 2 KV heads) with tied
and with untied embeddings, Qwen2 (biases on q, k and v), Qwen3 (a norm over each of q's and k's heads, whole
on every rank, its gradient summed over TP: ``replicated_with_grad_allreduce``) -- are split by
``hybrid.tp.hf_plan`` / ``hybrid.tp.apply_plan`` over the TP group of ``build_mesh(tp=2)`` and trained through
the ZeRO engine at TP 2 × DP 1 (world 2) and TP 2 × DP 2 (world 4), stages 0–3. Every run's losses (the DP mean), pre-clip
gradient norms and ``full_state_dict()`` weights match the unsplit model trained in this process with
``torch.optim.AdamW`` over the engine's default parameter groups and ``clip_grad_norm_`` (fp32, relative
error < 1e-5; the clip is active in every step, so a norm counting the TP-replicated norms twice would show).

How each model gets its values, all against one reference each:

- ``meta``: built under ``hybrid.empty_init()`` (parameters on meta, the rotary table computed), split, and
  given its values by ``hybrid.initialize(seed=, init_fn=model._init_weights)`` -- each split layer's init runs
  on the full tensor and the rank keeps its slice; the reference is ``hybrid.materialize`` of the unsplit model;
- ``seeded``: built the ordinary way after ``torch.manual_seed`` on every rank, so each rank keeps its slice of
  the full tensors; the reference is the same build;
- ``weights``: ``weights=`` a consolidated ``.safetensors`` of the reference model (another seed).

A plain PyTorch model (embedding, blocks of LayerNorm and two biased Linear layers, output layer) is split the
same way by a plan given as the job's ``parallel.tp_plan`` through ``Context.parallelize``: its row-parallel
biases are added once, after the sum.

Activation checkpointing runs through the model's own ``gradient_checkpointing_enable()`` (transformers 5:
``activation_checkpointing_enable()``). The cases of one world size share one spawned world; the references
are computed here.
"""

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import hybrid
from hybrid.comm.mesh import build_mesh
from hybrid.config.training import TrainConfig
from hybrid.runtime.local_launch import run_local
from hybrid.runtime.train import Context, JobSettings
from hybrid.tp import apply_plan, hf_plan
from hybrid.zero.param_groups import torch_param_groups

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.slow

VOCAB, SEQ, GLOBAL_BATCH, STEPS = 64, 8, 8, 4
SEED, FILE_SEED = 3, 11
LR, BETAS, EPS, WEIGHT_DECAY, CLIP = 1e-2, (0.9, 0.95), 1e-4, 0.1, 0.3  # eps: see tests/dist/test_zero_tp.py


OWN_PLAN = {"embed": "vocab", "blocks.*.up": "colwise", "blocks.*.down": "rowwise", "out": "colwise_rep"}


class Block(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, 4 * dim)
        self.down = nn.Linear(4 * dim, dim)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(self.norm(x))))


class OwnLM(nn.Module):
    """A model of one's own, forward as a Hugging Face causal LM's (``input_ids``, ``labels`` -> ``.loss``)."""

    def __init__(self, dim: int = 16):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, dim)
        self.blocks = nn.Sequential(Block(dim), Block(dim))
        self.out = nn.Linear(dim, VOCAB, bias=False)

    def forward(self, input_ids, labels):
        logits = self.out(self.blocks(self.embed(input_ids)))
        return SimpleNamespace(loss=F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten()))


def _config(name: str):
    if name == "own":
        return None
    shape = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=2 * SEQ, use_cache=False)
    if name == "qwen2":
        return transformers.Qwen2Config(**shape, tie_word_embeddings=False)
    if name == "qwen3":
        return transformers.Qwen3Config(**shape, head_dim=8, tie_word_embeddings=True)
    if name == "gemma2":  # a scaled input embedding, tied to the head; soft-capped logits
        return transformers.Gemma2Config(**shape, head_dim=8)
    if name == "apertus":  # xIELU's learnable scalars between the MLP's split layers
        return transformers.ApertusConfig(**shape, head_dim=8)
    if name == "neox":  # Pythia's shape: fused QKV, untied head named lm_head, embed_out.weight on disk
        return transformers.GPTNeoXConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                          num_attention_heads=4, max_position_embeddings=2 * SEQ, use_cache=False,
                                          tie_word_embeddings=False)
    return transformers.LlamaConfig(**shape, tie_word_embeddings=name == "llama-tied")


def _model_class(name: str):
    if name == "own":
        return lambda _: OwnLM()
    return transformers.AutoModelForCausalLM.from_config


# the local shape of one split projection per model: 2 KV heads of 8 features (one per TP rank), the own
# model's 64 up features (32 each), NeoX's fused QKV of 4 heads (2 per rank: 48 rows), Apertus's up_proj
SPLIT_SHAPES = {"own": ("up.weight", (32, 16)), "neox": ("query_key_value.weight", (48, 32)),
                "apertus": ("up_proj.weight", (32, 32))}


def _build(name: str, how: str):
    """The unsplit model: on meta (``empty_init``) for ``meta`` / ``weights``, with values for ``seeded``."""
    if how == "seeded":
        torch.manual_seed(SEED)
        return _model_class(name)(_config(name))
    with hybrid.empty_init():
        return _model_class(name)(_config(name))


def _train_config(stage: int) -> TrainConfig:
    return TrainConfig.from_dict({
        "zero": {"stage": stage, "reduce_bucket_size": 3000, "allgather_bucket_size": 3000,
                 "prefetch_bucket_size": 3000, "param_persistence_threshold": 40},
        "precision": "fp32",
        "optimizer": {"lr": LR, "betas": list(BETAS), "eps": EPS, "weight_decay": WEIGHT_DECAY},
        "gradient_clipping": CLIP,
    })


def _ids(step: int) -> torch.Tensor:
    """Arithmetic sequences mod the vocabulary: learnable, so the weights move in a way that matters."""
    g = torch.Generator().manual_seed(500 + step)
    start = torch.randint(0, VOCAB, (GLOBAL_BATCH, 1), generator=g)
    stride = torch.randint(1, 4, (GLOBAL_BATCH, 1), generator=g)
    return (start + stride * torch.arange(SEQ)) % VOCAB


def _reference(name: str, how: str, weights_file=None):
    model = _build(name, how)
    if how == "meta":
        hybrid.materialize(model, seed=SEED, init_fn=model._init_weights)
    elif how == "weights":
        hybrid.materialize(model, weights=weights_file)
    elif how == "pretrained":  # transformers' own reader of its own directory
        model = transformers.AutoModelForCausalLM.from_pretrained(weights_file, config=_config(name))
    opt_cfg = _train_config(0).optimizer
    opt = torch.optim.AdamW(torch_param_groups(model, opt_cfg), lr=LR, betas=BETAS, eps=EPS,
                            weight_decay=WEIGHT_DECAY, foreach=False)
    losses, norms = [], []
    for step in range(STEPS):
        ids = _ids(step)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP).item())
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, norms, {k: t.detach().clone() for k, t in model.state_dict().items()}


def _file_of_reference(name: str, path, how: str = "weights") -> str:
    """A consolidated .safetensors of the model with FILE_SEED's values (a tied tensor under one name), or for
    ``pretrained`` its ``save_pretrained`` directory in shards (transformers' own checkpoint keys)."""
    from safetensors.torch import save_model

    model = _build(name, "meta")
    hybrid.materialize(model, seed=FILE_SEED, init_fn=model._init_weights)
    if how == "pretrained":
        model.save_pretrained(str(path), max_shard_size="40KB")
    else:
        save_model(model, str(path))
    return str(path)


def _rank_runs(cases, files):
    mesh = build_mesh(tp=2)
    rows = slice(mesh.dp_rank * GLOBAL_BATCH // mesh.dp, (mesh.dp_rank + 1) * GLOBAL_BATCH // mesh.dp)
    out = {}
    for name, how, stage, checkpointing in cases:
        model = _build(name, how)
        if name == "own":  # the job's parallel.tp_plan, as an entrypoint applies it
            settings = JobSettings(steps=STEPS, micro_batch=GLOBAL_BATCH // mesh.dp, stage=stage, tp_plan=OWN_PLAN)
            model = Context(mesh, {}, settings, rank=dist.get_rank(), world_size=dist.get_world_size()
                            ).parallelize(model)
        else:
            apply_plan(model, hf_plan(model), mesh.tp_comm)
        suffix = SPLIT_SHAPES.get(name, ("k_proj.weight",))[0]
        split = {n: tuple(p.shape) for n, p in model.named_parameters() if n.endswith(suffix)}
        if checkpointing:  # transformers 5 renamed gradient_checkpointing_enable
            (getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable)()
        init_fn = getattr(model, "_init_weights", None)
        extra = dict(weights=files[(name, how)]) if how in FILED else dict(seed=SEED, init_fn=init_fn)
        engine = hybrid.initialize(model, _train_config(stage), dp_group=mesh.dp_group, tp_group=mesh.tp_group,
                                   **extra)
        losses, norms = [], []
        for step in range(STEPS):
            ids = _ids(step)[rows]
            loss = engine(input_ids=ids, labels=ids).loss
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
            norms.append(float(engine.last_grad_norm))
        out[(name, how, stage, checkpointing)] = dict(losses=losses, norms=norms, local_shapes=split,
                                                      weights=engine.full_state_dict(rank0_only=True))
    return out


def _rel(actual, expected) -> float:
    actual, expected = torch.as_tensor(actual), torch.as_tensor(expected)
    return ((actual - expected).abs().max() / expected.abs().max()).item()


FILED = ("weights", "pretrained")


def _check(world: int, cases, tmp_path):
    files = {(name, how): _file_of_reference(name, tmp_path / (name + (".safetensors" if how == "weights" else "")), how)
             for name, how in {c[:2] for c in cases if c[1] in FILED}}
    references = {(name, how): _reference(name, how, files.get((name, how))) for name, how, _, _ in cases}
    for ref_losses, ref_norms, _ in references.values():
        assert min(ref_norms) > CLIP, "the clip must trigger in every step"
        assert ref_losses[-1] < ref_losses[0], "the reference must learn, or the check is weak"
    results = run_local(_rank_runs, world, cases, files, timeout_s=400)
    dp = world // 2
    for case in cases:
        per_rank = [res[case] for res in results]
        ref_losses, ref_norms, ref_weights = references[case[:2]]
        # each DP rank's loss is the mean over its rows; the TP ranks of a group compute the same one
        losses = [sum(r["losses"][s] for r in per_rank) / world for s in range(STEPS)]
        assert _rel(losses, ref_losses) < 1e-5, f"{case}: losses {losses} vs {ref_losses}"
        for rank, res in enumerate(per_rank):
            assert _rel(res["norms"], ref_norms) < 1e-5, f"{case} rank {rank}: norms {res['norms']} vs {ref_norms}"
            assert set(res["local_shapes"].values()) == {SPLIT_SHAPES.get(case[0], (None, (8, 32)))[1]}, (case, res)
        weights = per_rank[0]["weights"]
        assert weights.keys() == ref_weights.keys(), case
        for key, ref in ref_weights.items():
            err = _rel(weights[key], ref)
            assert err < 1e-5, f"{case} (dp {dp}): {key} relative error {err:.3g}"


def test_hf_models_split_by_their_own_plan_at_tp2_dp2_match_single_process_adamw(tmp_path):
    cases = [(name, "meta", stage, False) for name in ("llama-tied", "llama", "qwen2") for stage in (0, 1, 2, 3)]
    cases += [("llama-tied", "seeded", 1, False), ("qwen2", "weights", 3, False), ("llama", "meta", 3, True),
              ("qwen2", "meta", 2, True), ("own", "seeded", 2, False), ("qwen3", "meta", 3, False)]
    cases += [(name, "pretrained", stage, False) for name in ("neox", "gemma2") for stage in (1, 3)]
    cases += [("apertus", "meta", 3, False)]
    _check(4, cases, tmp_path)


def test_hf_models_split_by_their_own_plan_at_tp2_dp1_match_single_process_adamw(tmp_path):
    cases = [(name, "meta", stage, False) for name in ("llama-tied", "qwen2") for stage in (0, 3)]
    cases += [("llama", "seeded", 2, False), ("llama-tied", "weights", 1, False), ("llama-tied", "meta", 3, True),
              ("own", "seeded", 0, False), ("own", "seeded", 3, False)]
    _check(2, cases, tmp_path)
