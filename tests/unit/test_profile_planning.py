"""The plan from the model's measured profile (``hybrid.plan.profile``), without Ray: a model other than the
built-in GPT gets activations and a time model from its profile (``launch.planning.model_size.ModelFigures``), a
transformers config gets the same on paper (``hybrid estimate --hf``), and a model whose profile cannot be taken
gets one sentence naming the op and the plan it got before.

The Llama 3 8B case is issue 44's: 32 layers, hidden 4096, MLP 14336, 32 heads / 8 KV heads, vocabulary 128256
(``max_position_embeddings`` 131072, as Llama 3.1's, so that 8192-token rows fit), ``hf.seq_len`` 8192, 2 nodes x
8 GPUs of 80 GB, micro-batch 4, global batch 64. Before the profile the plan chose TP 8, ZeRO-1, no activation
checkpointing at 10 GB per GPU, activations not counted; their profile at TP 8 alone is ~90 GB per GPU (the
logits split by vocabulary, as ``hybrid.models.hf:train`` leaves them at TP > 1; ~113 GB gathered).

Oracles: Korthikanti's formula (``hybrid.plan.memory.activation_bytes``) for the TP split of a block's bytes,
the built-in GPT's own formulas for its figures (the step before the GPT takes the same path), lower bounds any
layout must hold (the logits and each block's input), and the profile taken directly.
"""

import json
import time
from pathlib import Path

import pytest
import torch

from hybrid.models.gpt.model import GPT, GPTConfig, count_parameters
from hybrid.plan.cost import Layout, ModelShape, compute_flops, step_cost, tp_traffic
from hybrid.plan.memory import activation_bytes, profile_activation_bytes
from hybrid.plan.profile import ModelProfile, Part, Scaling, profile_config, profile_model
from launch.cli import main
from launch.planning import model_size
from launch.planning.model_size import ModelFigures, gpt_figures, logits_split, model_facts, model_figures
from tests.oracles import gpt_activation_bytes, gpt_model_shape
from launch.planning.plan import build_plan, format_plan
from launch.spec import load_spec, parse_spec

transformers = pytest.importorskip("transformers")

LLAMA3_8B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256,
             "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
             "num_key_value_heads": 8, "max_position_embeddings": 131072, "rope_theta": 500000.0,
             "rms_norm_eps": 1e-5, "hidden_act": "silu", "tie_word_embeddings": False,
             "bos_token_id": 128000, "eos_token_id": 128001}
SEQ, MICRO, GLOBAL, V, H, L = 8192, 4, 64, 128256, 4096, 32


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("llama3-8b")
    (root / "llama").mkdir()
    (root / "llama" / "config.json").write_text(json.dumps(LLAMA3_8B))
    (root / "model.yaml").write_text(f"hf: {{config: llama/config.json, seq_len: {SEQ}}}\n")
    (root / "cluster.yaml").write_text(
        "cluster: {address: auto, nodes: 2, gpus_per_node: 8, gpu_memory_gb: 80,\n"
        "          interconnect: {intra_node: nvlink, inter_node: infiniband}}\n"
        "job: {entrypoint: 'hybrid.models.hf:train', config: model.yaml, steps: 10, "
        f"micro_batch: {MICRO}, global_batch: {GLOBAL}}}\n"
        "parallel: {tp: auto, zero_stage: auto}\n")
    return root


@pytest.fixture(scope="module")
def llama_plan(llama_dir):
    spec = load_spec(llama_dir / "cluster.yaml")
    facts = model_facts(spec)
    return spec, facts, build_plan(spec, facts=facts)


# ----------------------------------------------------------------------------------------- hybrid plan: Llama 3 8B


def test_the_llama_3_8b_plan_counts_its_activations_and_chooses_a_layout_that_holds_them(llama_plan):
    spec, facts, lp = llama_plan
    p, tm, figures = lp.plan, lp.time, lp.figures
    assert figures.plain is not None and figures.note == "" and figures.plain.layers == L
    chosen = tm.chosen.layout
    assert (lp.layout.tp, p.stage, p.activation_checkpointing, lp.micro_batch) == \
        (chosen.tp, chosen.stage, chosen.activation_checkpointing, chosen.micro_batch)
    # the chosen layout's peak includes its activations, the profile's at its micro-batch, TP and checkpointing
    acts = figures.activation_bytes(lp.micro_batch, lp.layout.tp, p.activation_checkpointing)
    assert p.chosen_activation_bytes == acts == lp.activation_bytes(lp.micro_batch, p.activation_checkpointing)
    assert p.per_gpu_bytes <= p.usable_bytes and tm.chosen.fits and tm.chosen.device_bytes <= p.usable_bytes
    # any layout holds its slice of the logits (bf16: split by vocabulary over TP, as hybrid.tp.splits_logits says
    # the ranks keep them) and each block's input
    assert figures.logits_split
    assert acts >= MICRO * SEQ * V * 2 / lp.layout.tp + L * MICRO * SEQ * H * 2 / lp.layout.tp
    # what the plan chose before (TP 8, ZeRO-1, no checkpointing, micro-batch 4) holds ~90 GB of activations
    before = [c for c in tm.ranking.candidates if (c.layout.tp, c.layout.stage, c.layout.activation_checkpointing,
                                                   c.layout.offload, c.layout.micro_batch) == (8, 1, False, False, 4)]
    assert before and not any(c.fits for c in before)
    assert figures.activation_bytes(MICRO, 8) > 85e9
    assert {c.layout.tp for c in tm.ranking.candidates} == {1, 2, 4, 8}


def test_the_llama_3_8b_plan_prints_the_memory_and_time_tables(llama_plan, llama_dir, capsys):
    _, _, lp = llama_plan
    text = format_plan(lp)
    assert "not estimated" not in text
    assert "activations ~" in text and "(profiled from LlamaForCausalLM at 8192 tokens)" in text
    assert "  layout " in text and "tokens/s" in text and "MFU" in text and "<- chosen" in text
    assert "FLOPs, ops and activations profiled from LlamaForCausalLM at 8192 tokens" in text
    rates = [c.cost.tokens_per_s for c in lp.time.ranking.fitting]
    assert rates == sorted(rates, reverse=True) and len(rates) > 10  # ranked by predicted step time
    assert main(["plan", str(llama_dir / "cluster.yaml")]) == 0  # the command, as a user runs it
    out = capsys.readouterr().out
    assert "activations not estimated" not in out and "time not estimated" not in out and "<- chosen" in out


def test_the_profile_of_an_8b_config_is_taken_in_seconds_and_once_per_process(llama_plan):
    spec, facts, lp = llama_plan
    start = time.perf_counter()
    again = model_figures(facts, spec.parallel.precision)
    assert time.perf_counter() - start < 0.5 and again.plain == lp.figures.plain  # cached per (model, seq)
    model_size._PROFILES.clear()
    start = time.perf_counter()
    fresh = model_figures(facts, spec.parallel.precision)  # two profiles: plain and checkpointed
    assert time.perf_counter() - start < 10 and fresh.plain == lp.figures.plain


# ----------------------------------------------------------------------------------------- hybrid estimate --hf


def _estimate(capsys, *extra):
    code = main(["estimate", *extra])
    out, err = capsys.readouterr()
    return code, out, err


def test_estimate_hf_gives_the_profiles_activations(llama_dir, llama_plan, capsys):
    args = ["--hf", str(llama_dir / "llama"), "--gpus", "16", "--tp", "8", "--gpus-per-node", "8",
            "--seq", str(SEQ), "--micro-batch", str(MICRO)]
    code, out, err = _estimate(capsys, *args, "--json")
    assert code == 0, err
    doc = json.loads(out)
    config = transformers.AutoConfig.from_pretrained(str(llama_dir / "llama"))
    plain = profile_config(config, 1, SEQ, dtype=torch.bfloat16)  # the profile, taken here
    checkpointed = profile_config(config, 1, SEQ, dtype=torch.bfloat16, checkpointing=True)
    expected = profile_activation_bytes(plain, checkpointed, SEQ, MICRO, 8, logits_split=True)  # as train splits them
    assert doc["activations_estimate"] == "profile" and doc["activations_gb"] * 1e9 == pytest.approx(expected)
    assert doc["params"] == plain.params == llama_plan[1].params
    assert doc["profile"]["checkpointed_activation_bytes"] == profile_activation_bytes(plain, checkpointed, SEQ,
                                                                                        MICRO, 8, True, True)
    assert doc["profile"]["activation_bytes"] == llama_plan[2].figures.activation_bytes(MICRO, 8)  # the plan's
    assert doc["recommended_stage"] == 3 and doc["activation_checkpointing"]  # 90 GB of activations do not fit
    code, out, err = _estimate(capsys, *args, "--time", "--global-batch", str(GLOBAL))
    assert code == 0, err
    assert "Activations (profile)" in out and "Profile: LlamaForCausalLM of config.json, 32 blocks" in out
    assert "  layout " in out and "<- chosen" in out and "Fastest: tp " in out


@pytest.mark.parametrize("extra, named", [
    (["--layers", "32"], "--hf gives the model's shape, so leave out --layers"),
    (["--vocab", "128256"], "leave out --vocab"),
    (["--tp", "16", "--gpus", "16"], "--tp (16) cannot split the model of --hf: LlamaConfig.num_key_value_heads is 8"),
    (["--params", "7B"], "--params is 7,000,000,000, but the model of --hf has 8,030,261,248 parameters"),
])
def test_estimate_hf_refusals_are_one_sentence(llama_dir, capsys, extra, named):
    base = {"--gpus": "8", "--seq": "64", "--micro-batch": "1"}
    for key, value in zip(extra[::2], extra[1::2]):
        base[key] = value
    code, out, err = _estimate(capsys, "--hf", str(llama_dir / "llama"), *[x for kv in base.items() for x in kv])
    assert code == 2 and out == "" and err.count("\n") == 1 and named in err, err
    code, out, err = _estimate(capsys, "--hf", str(llama_dir / "llama"), "--gpus", "8", "--micro-batch", "1")
    assert code == 2 and "--hf needs --seq too" in err
    code, out, err = _estimate(capsys, "--gpus", "8")
    assert code == 2 and "--params is missing; give the parameter count" in err


# ----------------------------------------------------------------------------------------- a profile that fails


READS_VALUES = """
import torch
from torch import nn


class ReadsValues(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(16, 8)
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))

    def forward(self, ids, targets):
        x = self.emb(ids)
        for block in self.blocks:
            x = block(x)
        return (x * float(ids.max().item())).sum()


def build_model(model_config, tp_comm=None):
    return ReadsValues()


def train(ctx):
    pass
"""


def _own(tmp_path, name, model_yaml):
    (tmp_path / f"{name}.py").write_text(READS_VALUES)
    (tmp_path / "model.yaml").write_text(model_yaml)
    return parse_spec({"cluster": {"address": "local", "nodes": 1, "gpus_per_node": 2, "gpu_memory_gb": 80},
                       "job": {"entrypoint": f"{name}:train", "config": "model.yaml", "steps": 3},
                       "parallel": {"precision": "fp32"}}, base_dir=tmp_path)


def test_a_model_whose_profile_fails_gets_the_sentence_and_the_plan_it_had(tmp_path):
    lp = build_plan(_own(tmp_path, "reads_values_a", "seq_len: 16\n"))
    note = lp.figures.note
    assert note.startswith("the profile of ReadsValues could not be taken: its step stopped at "
                           "aten._local_scalar_dense") and ".item()" in note and "\n" not in note
    text = format_plan(lp)
    assert f"activations not estimated: {note}" in text and f"time not estimated: {note}; the memory-only choice" \
        in text
    assert lp.plan.activation_bytes == 0 and lp.time.ranking is None and lp.layout.tp == 1  # as before the profile
    lp = build_plan(_own(tmp_path, "reads_values_b", "layers: 2\n"))  # no sequence length to profile at
    assert "says no sequence length" in lp.figures.note and "seq_len:" in format_plan(lp)


OWN_LOOP = """
import torch.nn.functional as F
from torch import nn


class Stack(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(64, 32)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(32, 128), nn.GELU(), nn.Linear(128, 32))
                                    for _ in range(3))
        self.out = nn.Linear(32, 64)

    def forward(self, ids, targets):
        x = self.emb(ids)
        for block in self.blocks:
            x = x + block(x)
        return F.cross_entropy(self.out(x).flatten(0, 1), targets.flatten())


def build_model(model_config, tp_comm=None):
    return Stack()


def train(ctx):
    pass
"""


def test_a_models_own_loop_is_profiled_and_planned_without_checkpointing_it_does_not_apply(tmp_path):
    (tmp_path / "own_loop_a.py").write_text(OWN_LOOP)
    (tmp_path / "model.yaml").write_text("model: {seq_len: 32}\n")

    def spec(**parallel):
        return parse_spec({"cluster": {"address": "local", "nodes": 1, "gpus_per_node": 2, "gpu_memory_gb": 80},
                           "job": {"entrypoint": "own_loop_a:train", "config": "model.yaml", "steps": 3},
                           "parallel": {"precision": "fp32", **parallel}}, base_dir=tmp_path)

    lp = build_plan(spec())
    assert lp.figures.plain.model == "Stack" and lp.figures.plain.layers == 3 and lp.figures.seq == 32
    assert lp.plan.activation_bytes == lp.figures.activation_bytes(lp.micro_batch, 1) > 0
    assert {c.layout.activation_checkpointing for c in lp.time.ranking.candidates} == {False}
    assert "not weighed: the job's own loop applies it only where it is true" in format_plan(lp)
    lp = build_plan(spec(activation_checkpointing=True))  # the user says the loop applies it
    assert lp.plan.activation_checkpointing and lp.plan.chosen_activation_bytes == \
        lp.figures.activation_bytes(lp.micro_batch, 1, True) < lp.plan.activation_bytes


# ----------------------------------------------------------------------------------------- the pure parts


def _part(saved, whole=0.0, flops=0.0):
    return Part(Scaling(flops), Scaling(2 * flops), Scaling(saved), 10, Scaling(whole))


def _profile(block, outside, head, checkpointing=False):
    return ModelProfile("M", 100, 4, "blocks", block, outside, Scaling(head), checkpointing, "bfloat16", "fused",
                        ((1, 8), (1, 4)), 16)


def test_activations_at_tp_split_a_block_but_its_residual_width_and_gathered_logits():
    plain = _profile(_part(40.0, whole=8.0, flops=6.0), _part(30.0, flops=1.0), head=24.0)
    ckpt = _profile(_part(2.0, whole=2.0, flops=6.0), _part(30.0, flops=1.0), head=24.0, checkpointing=True)
    tokens = 3 * 10  # micro-batch 3, 10 tokens: every figure above is per token
    assert profile_activation_bytes(plain, ckpt, 10, 3) == tokens * (4 * 40 + 30)
    # TP 4: each block keeps its 8 whole bytes and a quarter of the other 32; the logits whole unless split
    assert profile_activation_bytes(plain, ckpt, 10, 3, tp=4) == tokens * (4 * (8 + 8) + 6 + 24)
    assert profile_activation_bytes(plain, ckpt, 10, 3, tp=4, logits_split=True) == tokens * (4 * 16 + 6 + 6)
    # checkpointing: the blocks' inputs, whole, and one block's plain bytes while it is recomputed
    assert profile_activation_bytes(plain, ckpt, 10, 3, checkpointing=True) == tokens * (4 * 2 + 30 + 40)
    assert profile_activation_bytes(plain, ckpt, 10, 3, tp=4, checkpointing=True) == tokens * (4 * 2 + 30 + 16)


def test_a_blocks_tp_split_agrees_with_korthikanti():
    # the GPT on SDPA's math path keeps what Korthikanti counts: whole, s*b*h*10 (norms, residuals); split, the rest
    with torch.device("meta"):
        gpt = GPT(GPTConfig(vocab_size=512, seq_len=512, n_layers=4, hidden=256, n_heads=8), device="meta")
    plain = profile_model(gpt, 2, 512, attention="math", dtype=torch.bfloat16)
    ckpt = profile_model(gpt, 2, 512, attention="math", dtype=torch.bfloat16, checkpointing=True)
    assert plain.width == 256 and plain.block_whole_bytes(2, 512) == 10 * 2 * 512 * 256
    outside = plain.activation_bytes(2, 512) - 4 * plain.block_bytes(2, 512)
    for tp in (1, 2, 4, 8):
        blocks = profile_activation_bytes(plain, ckpt, 512, 2, tp, logits_split=True) - \
            (outside - plain.head_bytes(2, 512)) - plain.head_bytes(2, 512) / tp
        ratio = blocks / activation_bytes(512, 2, 256, 8, 4, tp)
        assert 0.88 <= ratio <= 0.95, (tp, ratio)  # measured 0.895 .. 0.935: no dropout masks, the s² term


def test_the_plan_prices_the_logits_split_exactly_where_the_loop_keeps_them_split():
    """``model_size.logits_split`` is ``hybrid.tp.splits_logits``'s answer for a Hugging Face causal LM as the launcher
    holds it (split by its own plan at TP 1): a Llama's logits stay split at TP > 1, a head whose forward adds a
    tensor over the vocabulary keeps them gathered; ``estimate --hf`` asks the config's model the same."""
    from hybrid.tp import splits_logits
    from tests.unit.test_hf_logits import SHAPE as TINY, VocabBias

    config = transformers.LlamaConfig(**TINY)
    for cls, split in ((transformers.LlamaForCausalLM, True), (VocabBias, False)):
        with torch.device("meta"):
            model = cls(config)
        model_size.split_by_plan(model, None, "the test")
        assert logits_split(model) is split and splits_logits(model, 2) is split, cls.__name__
    figures = model_size.config_figures(config, 8, "fp32")
    assert figures.logits_split
    assert figures.activation_bytes(2, 2) == profile_activation_bytes(figures.plain, figures.checkpointed, 8, 2, 2,
                                                                      logits_split=True)


def test_the_built_in_gpt_is_planned_by_its_profile_and_its_formulas_are_the_oracle():
    """The GPT goes through the same path as any model (``gpt_figures``: two blocks profiled, scaled to its layers),
    and its analytic formulas (tests/oracles.py) check it: the FLOPs within 4 % (fused attention's backward
    recomputes the scores: +2·L·h·s), the activations 78-92 % of Korthikanti's accounting (which counts contiguous
    q, k, v copies and an attention-output copy that autograd does not keep: the measured peaks of
    tests/dist/test_memory_prediction.py follow the profile, within 5 % at DP 2), the recompute below the
    formula's whole forward (torch's checkpoint stops recomputing once the saved tensors are back: the MLP's down
    projection is not run again)."""
    cfg = GPTConfig(vocab_size=512, seq_len=512, n_layers=4, hidden=256, n_heads=8)
    with torch.device("meta"):
        gpt = GPT(cfg, device="meta")
    assert logits_split(gpt)  # its head is vocab-parallel, with a vocab-parallel loss
    params = count_parameters(cfg)
    figures = gpt_figures(cfg.to_dict(), "bf16")
    assert figures.params == params and figures.plain.layers == 4 and figures.logits_split
    plain, ckpt = (profile_model(gpt, 1, 512, dtype=torch.bfloat16, checkpointing=c) for c in (False, True))
    for tp in (1, 2, 4):
        for ac in (False, True):  # two blocks scaled to four: as the whole model's profile
            whole = profile_activation_bytes(plain, ckpt, 512, 4, tp, ac, logits_split=True)
            assert figures.activation_bytes(4, tp, ac) == pytest.approx(whole, rel=1e-9)
            ratio = figures.activation_bytes(4, tp, ac) / gpt_activation_bytes(512, 4, 256, 8, 4, 512, tp=tp,
                                                                                 precision="bf16", checkpointing=ac)
            assert 0.78 <= ratio <= 0.92, (tp, ac, ratio)
    lay = Layout(1, 2, 2, 1, 4, 2)
    measured, analytic = figures.cost_shape(), gpt_model_shape(params, cfg.to_dict())
    assert compute_flops(measured, lay)[0] == pytest.approx(plain.flops(4 * 2, 512) / 2, rel=1e-9)
    assert abs(compute_flops(measured, lay)[0] / compute_flops(analytic, lay)[0] - 1) < 0.04
    ac = Layout(1, 2, 2, 1, 4, 2, True)
    assert compute_flops(measured, ac)[1] == pytest.approx((ckpt.flops(8, 512) - plain.flops(8, 512)) / 2, rel=1e-9)
    assert 0.6 < compute_flops(measured, ac)[1] / compute_flops(analytic, ac)[1] < 1.0
    assert measured.tp_block.forward == measured.tp_block.backward == 2  # Megatron's: f and g of attention and MLP
    assert (measured.layers, measured.hidden, measured.params) == (4, 256, params)


def test_a_profiled_shape_prices_a_step():
    shape = ModelShape.from_profile(_profile(_part(1.0, flops=6.0), _part(1.0, flops=1.0), 0.0),
                                    _profile(_part(1.0, flops=8.0), _part(1.0, flops=1.0), 0.0), 10)
    assert shape.flop_terms == (4 * 18.0 + 3.0, 0.0) and shape.recompute_terms == (4 * 6.0, 0.0)
    lay = Layout(1, 2, 2, 1, 3, 2, True)
    assert compute_flops(shape, lay) == (75.0 * 60 / 2, 24.0 * 60 / 2)  # 3 x 2 rows of 10 tokens, over TP 2
    from hybrid.plan.hardware import build_hardware

    cost = step_cost(shape, lay, build_hardware("cpu", "fp32", "loopback", "loopback", 2))
    tp_calls = tp_traffic(shape, lay)[1] / lay.accumulation
    assert cost.terms["micro_ops"] == 2 * shape.ops_per_micro_step(True, lay.stage, tp_calls) and cost.step_s > 0
    assert shape.ops_per_micro_step(True, lay.stage, tp_calls) > shape.ops_per_micro_step(True)  # + TP's ops
