"""What hybrid does with a model's own TP plan beyond its words, found from the model itself (no process group):

- whole parameters between split layers (Apertus's xIELU scalars, a norm of one's own) get their gradient
  summed over TP (``replicate_grad``), and the plan line says so; a whole parameter that meets both slices and
  whole activations, or a whole activation with a gradient that meets a slice, is one sentence
  (``hybrid.tp.regions``, ``hybrid.tp.plan.grad_sums``);
- an embedding whose forward goes through ``nn.Embedding``'s (Gemma's scaled one) is split around it; one
  whose forward does not is left whole, with a head tied to it;
- a mixture-of-experts model is not split (TP 1, one sentence); patterns of a model's own plan that match
  nothing are left out, as transformers does, and a bare parameter it names (attention sinks) is split;
- the styles ``embedding_col`` and ``mla_kv_a_proj`` compute at TP 1 what the unsplit module does.

The values at TP 2 against single-process AdamW are tests/dist/test_hf_tp.py's.
"""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import hybrid
from hybrid.errors import ConfigError
from hybrid.tp import apply_plan
from hybrid.tp.hf import hf_plan
from hybrid.tp.plan import OwnPlan, plan_notes, tp_refusal
from hybrid.tp.regions import SLICE, trace_regions
from hybrid.weights.attrs import tensor_parallel_dim

transformers = pytest.importorskip("transformers")
SHAPE = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=32, head_dim=8)


def _hf(config_class, **extra):
    with hybrid.empty_init():
        return transformers.AutoModelForCausalLM.from_config(getattr(transformers, config_class)(**SHAPE, **extra))


class Gated(nn.Module):
    """Token ids in; an MLP with a learnable gate on its hidden features, between the split layers."""

    def __init__(self, dim=8, hidden=16):
        super().__init__()
        self.embed = nn.Embedding(10, dim)
        self.up, self.down = nn.Linear(dim, hidden), nn.Linear(hidden, dim)
        self.gate = nn.Parameter(torch.full((1,), 0.5))
        self.scale = nn.Parameter(torch.ones(dim))

    def forward(self, ids):
        x = self.embed(ids)
        return x + self.down(F.silu(self.up(x)) * self.gate) * self.scale


PLAN = {"up": "colwise", "down": "rowwise"}


def test_a_whole_parameter_between_split_layers_gets_its_gradient_summed_and_the_plan_says_so():
    model, ref = Gated(), Gated()
    ref.load_state_dict(model.state_dict())
    x = torch.randint(0, 10, (2, 3))
    apply_plan(model, PLAN, None)
    assert type(model).__name__ == "GradSummedReplicaGated"  # the module holding gate: its parameters summed
    assert plan_notes(model) == ["gradients of the whole parameters between split layers summed over TP (gate)"]
    assert torch.equal(model(x), ref(x))  # at TP 1 the same model


def test_apertus_xielu_scalars_are_found_from_the_model_and_summed():
    model = _hf("ApertusConfig")
    apply_plan(model, hf_plan(model), None)
    act = model.model.layers[0].mlp.act_fn
    assert act.tp_style == "replicate_grad"
    assert plan_notes(model) == ["gradients of the whole parameters between split layers summed over TP "
                                 "(model.layers.*.mlp.act_fn.alpha_p, model.layers.*.mlp.act_fn.alpha_n)"]
    assert plan_notes(_split(_hf("LlamaConfig"))) == []  # nothing between Llama's split layers


def _split(model):
    return apply_plan(model, hf_plan(model), None)


def test_a_split_no_sum_makes_exact_is_one_sentence():
    class Shared(Gated):  # one scale both inside and outside the split region
        def forward(self, ids):
            x = self.embed(ids)
            return x * self.gate + self.down(F.silu(self.up(x)) * self.gate)

    with pytest.raises(ConfigError) as err:
        apply_plan(Shared(), PLAN, None)
    assert str(err.value).startswith("the TP plan cannot split Shared exactly: the whole parameter gate meets both "
                                     "this rank's slice of the features (in mul) and whole activations")
    with pytest.raises(ConfigError) as err:  # the residual meets the slices: no rowwise sums them
        apply_plan(Gated(), {"up": "colwise"}, None)
    assert str(err.value) == ("the TP plan cannot split Gated exactly: a whole activation that needs a gradient meets "
                              "this rank's slice of the features in add, so its gradient would hold this rank's "
                              "part only; use tp 1, or a plan whose split layers enclose that computation.")


def test_a_forward_that_cannot_run_on_meta_is_said_not_silently_passed():
    class NeedsValues(Gated):
        def forward(self, ids):
            if ids.sum().item() > 0:  # data-dependent Python
                ids = ids * 2
            return super().forward(ids)

    model = NeedsValues()
    trace = trace_regions(model, {model.up: SLICE}, set(), example=(torch.zeros(2, 8, dtype=torch.long, device="meta"),))
    assert trace.error.startswith("DataDependentOutputException")  # .item() of a value no trace has
    apply_plan(model, PLAN, None)
    assert plan_notes(model)[0].startswith("not checked for whole parameters between split layers (its forward "
                                           "did not run on meta: ")


def test_gemma2s_scaled_embedding_is_split_around_its_own_forward():
    model = _hf("Gemma2Config")
    plan = hf_plan(model)
    assert plan["model.embed_tokens"] == "vocab"
    apply_plan(model, plan, None)
    assert tensor_parallel_dim(model.model.embed_tokens.weight) == 0
    assert plan_notes(model) == ["model.embed_tokens split by vocabulary around its own forward "
                                 "(Gemma2TextScaledWordEmbedding)"]
    ref = transformers.Gemma2ForCausalLM(transformers.Gemma2Config(**SHAPE))
    split = transformers.Gemma2ForCausalLM(transformers.Gemma2Config(**SHAPE))
    split.load_state_dict(ref.state_dict())
    _split(split)
    ids = torch.randint(0, 64, (2, 6))
    assert torch.equal(split(input_ids=ids).logits, ref(input_ids=ids).logits)


def test_an_embedding_whose_forward_bypasses_torchs_stays_whole_with_its_tied_head():
    class Own(nn.Embedding):
        def forward(self, ids):
            return F.embedding(ids, self.weight) * 2

    model = _hf("LlamaConfig", tie_word_embeddings=True)
    model.model.embed_tokens = Own(64, 32)
    model.tie_weights()
    plan = hf_plan(model)
    assert "model.embed_tokens" not in plan and "lm_head" not in plan
    assert plan.notes == ["model.embed_tokens left whole (Own's forward does not go through nn.Embedding's)",
                          "lm_head left whole (tied to the whole input embedding)"]


def test_a_mixture_of_experts_model_runs_at_tp_1_with_one_sentence():
    with pytest.raises(ConfigError) as err:
        hf_plan(_hf("MixtralConfig", num_local_experts=4, num_experts_per_tok=2))
    assert str(err.value) == ("MixtralForCausalLM's own TP plan is not used: MixtralForCausalLM is a mixture-of-"
                              "experts model (4 experts), which hybrid trains at TP 1 with its experts sharded by "
                              "ZeRO until expert parallelism exists.")


def test_a_models_own_plan_leaves_out_what_matches_nothing_and_splits_bare_parameters():
    model = Gated()
    model.sinks = nn.Parameter(torch.zeros(16))
    with pytest.raises(ConfigError, match="matches no module"):
        apply_plan(Gated(), {**PLAN, "nowhere": "colwise"}, None)  # a user's plan: strict
    apply_plan(model, OwnPlan({**PLAN, "nowhere": "colwise", "sinks": "colwise"}), None)
    assert tensor_parallel_dim(model.sinks) == 0
    assert tp_refusal(model, 2) is None and tp_refusal(model, 32) is not None
    with pytest.raises(ConfigError, match="hybrid splits a bare parameter colwise only"):
        apply_plan(Gated(), OwnPlan({**PLAN, "gate": "rowwise"}), None)


def test_granite_swa_sinks_and_local_params_split_by_their_own_plan():
    model = _hf("GraniteSWAConfig")
    apply_plan(model, hf_plan(model), None)
    assert tensor_parallel_dim(model.model.layers[0].self_attn.sinks) == 0


def test_embedding_col_and_mla_kv_a_proj_compute_the_unsplit_module_at_tp_1():
    embed, ref_embed = nn.Embedding(10, 8), nn.Embedding(10, 8)
    ref_embed.load_state_dict(embed.state_dict())
    host = nn.Module()
    host.embed = embed
    apply_plan(host, {"embed": "embedding_col"}, None)
    ids = torch.randint(0, 10, (2, 3))
    assert tensor_parallel_dim(embed.weight) == 1 and torch.equal(embed(ids), ref_embed(ids))
    model = _hf("MiniCPM3Config", q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=4, qk_rope_head_dim=4,
                v_head_dim=8)
    apply_plan(model, hf_plan(model), None)
    proj = model.model.layers[0].self_attn.kv_a_proj_with_mqa
    assert proj.tp_style == "mla_kv_a_proj" and proj.rope_dim == 4
    x = torch.randn(2, proj.in_features)
    proj.weight = nn.Parameter(torch.randn(proj.out_features, proj.in_features))
    if proj.bias is not None:
        proj.bias = nn.Parameter(torch.zeros(proj.out_features))
    assert torch.equal(proj(x), F.linear(x, proj.weight, proj.bias))


def test_a_reduction_over_the_split_features_is_refused_and_one_over_a_heads_own_is_not():
    class Sparse(Gated):  # Gemma 3n's activation sparsity: a mean over the MLP's columns
        def forward(self, ids):
            x = self.embed(ids)
            h = self.up(x)
            return x + self.down(F.relu(h - h.mean(-1, keepdim=True)))

    class PerHead(Gated):  # a norm inside each head of 4 features: whole on every rank
        def forward(self, ids):
            x = self.embed(ids)
            h = self.up(x).unflatten(-1, (4, 4))
            return x + self.down((h - h.mean(-1, keepdim=True)).flatten(-2))

    with pytest.raises(ConfigError) as err:
        apply_plan(Sparse(), PLAN, None)
    assert str(err.value).startswith("the TP plan cannot split Sparse exactly: mean reduces over the features the "
                                     "plan splits")
    apply_plan(PerHead(), PLAN, None)
