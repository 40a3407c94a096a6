"""TP plans (hybrid.tp.plan, hybrid.tp.hf) without a process group: what a plan matches, what it refuses
(one sentence naming the module and the fix), a Hugging Face model's own plan, and ``hybrid.empty_init``.

Splitting over a real TP group, and the values of split models against the unsplit one, are
tests/dist/test_hf_tp.py's."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import hybrid
from hybrid.errors import ConfigError
from hybrid.tp import ColumnParallelLinear, apply_plan, check_plan
from hybrid.tp.hf import hf_plan, parallelize
from hybrid.tp.hf_config import config_refusal, heads_refusal, largest_tp
from hybrid.config.tp_plan import normalize_plan, pattern_matches
from hybrid.tp.plan import largest_degree, tp_refusal
from hybrid.weights.attrs import tensor_parallel_dim


class Block(nn.Module):
    def __init__(self, dim=8, hidden=12, bias=True):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, hidden, bias=bias)
        self.down = nn.Linear(hidden, dim, bias=bias)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(self.norm(x))))


class Net(nn.Module):
    def __init__(self, vocab=16, dim=8, hidden=12, tied=False):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim, hidden) for _ in range(2))
        self.head = nn.Linear(dim, vocab, bias=False)
        if tied:
            self.head.weight = self.embed.weight

    def forward(self, ids):
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


PLAN = {"embed": "vocab", "blocks.*.up": "colwise", "blocks.*.down": "rowwise", "head": "colwise_rep"}


def _refused(plan, model=None, tp=2) -> str:
    with pytest.raises(ConfigError) as err:
        check_plan(model if model is not None else Net(), plan, tp)
    return str(err.value)


def test_patterns_match_whole_parts_with_shell_wildcards():
    assert pattern_matches("blocks.*.up", "blocks.0.up") and pattern_matches("blocks.*.up", "blocks.11.up")
    assert not pattern_matches("blocks.*.up", "blocks.0.up.x") and not pattern_matches("blocks.*", "blocks.0.up")
    assert pattern_matches("layers.*.mlp.*_proj", "layers.3.mlp.gate_proj")
    assert [n for n, _, _ in check_plan(Net(), PLAN, 2)] == ["embed", "blocks.0.up", "blocks.0.down", "blocks.1.up",
                                                             "blocks.1.down", "head"]


def test_hugging_face_spellings_mean_the_same_styles():
    plan = normalize_plan({"a": "colwise_gather_output", "b": "embedding_rowwise", "c": "rowwise_split_input",
                           "d": "local_colwise", "e": "gather", "f": "colwise_rep", "g": "replicate",
                           "h": "replicated_with_grad_allreduce"})
    assert plan == {"a": "colwise_rep", "b": "vocab", "c": "rowwise_rep", "d": "colwise", "e": "all_reduce",
                    "f": "colwise_rep", "g": "replicate", "h": "replicate_grad"}


def test_a_plan_at_tp_1_marks_the_split_but_changes_no_value_name_or_kind():
    model, plain = Net(tied=True), Net(tied=True)
    ids = torch.randint(0, 16, (2, 5))
    keys = list(model.state_dict())
    apply_plan(model, {**PLAN, "head": "colwise_rep"}, None)
    assert list(model.state_dict()) == keys and torch.equal(model(ids), plain(ids))
    assert isinstance(model.blocks[0].up, nn.Linear) and isinstance(model.embed, nn.Embedding)
    assert model.head.weight is model.embed.weight  # still one tensor
    dims = {n: tensor_parallel_dim(p) for n, p in model.named_parameters()}
    assert dims == {"embed.weight": 0, "blocks.0.norm.weight": None, "blocks.0.norm.bias": None,
                    "blocks.0.up.weight": 0, "blocks.0.up.bias": 0, "blocks.0.down.weight": 1,
                    "blocks.0.down.bias": None, "blocks.1.norm.weight": None, "blocks.1.norm.bias": None,
                    "blocks.1.up.weight": 0, "blocks.1.up.bias": 0, "blocks.1.down.weight": 1,
                    "blocks.1.down.bias": None}
    assert "tp=1 (colwise)" in repr(model.blocks[0].up) and "out_features=12" in repr(model.blocks[0].up)
    assert tp_refusal(model, 2) is None and tp_refusal(model, 4) is None
    assert tp_refusal(model, 8) == "blocks.0.up (colwise) has out_features=12, not divisible by 8"
    assert largest_degree(model, 8) == (4, {8: tp_refusal(model, 8)})


def test_an_unknown_style_is_one_sentence_listing_the_known_ones():
    msg = _refused({"blocks.*.up": "sequence_parallel"})
    assert msg.startswith("the TP plan['blocks.*.up'] is 'sequence_parallel', which is not a TP style hybrid "
                          "implements; use one of colwise, colwise_rep, rowwise,"), msg


def test_a_pattern_matching_no_module_is_one_sentence_naming_it():
    msg = _refused({"blocks.*.fc1": "colwise"})
    assert msg == ("the TP plan['blocks.*.fc1'] matches no module of Net (its layers are named like embed, "
                   "blocks.0.up, blocks.0.down); correct the pattern or remove it."), msg
    msg = _refused({"blocks.*.up.weight": "colwise"})
    assert msg == ("the TP plan['blocks.*.up.weight'] names the parameter blocks.0.up.weight, not a module; a plan "
                   "splits modules (name the module: blocks.0.up)."), msg


def test_a_split_size_the_degree_does_not_divide_is_one_sentence_naming_module_and_numbers():
    msg = _refused({"blocks.*.up": "colwise"}, Net(hidden=10), tp=4)
    assert msg == ("the TP plan: blocks.0.up (colwise) has out_features=10, which tp=4 does not divide; use a TP "
                   "degree that divides 10, or leave blocks.0.up out of the plan."), msg


def test_a_local_rowwise_layer_with_a_bias_is_refused():
    """Each rank would add the bias to its partial product before the module above sums them: tp times."""
    msg = _refused({"blocks.*.down": "local_rowwise", "blocks.*": "all_reduce"})
    assert msg.startswith("the TP plan: blocks.0.down is local_rowwise with a bias, which every TP rank would add "
                          "to its partial sum before the sum (counting it tp times); use rowwise"), msg
    plan = {"blocks.*.up": "colwise", "blocks.*.down": "local_rowwise", "blocks.*": "all_reduce"}
    model = Net()
    for block in model.blocks:
        block.down.bias = None
    assert [s for _, _, s in check_plan(model, plan, 2)] == ["all_reduce", "colwise", "local_rowwise"] * 2


def test_a_tied_tensor_split_differently_is_refused():
    msg = _refused({"head": "colwise_rep"}, Net(tied=True))
    assert msg == ("the TP plan: embed.weight is tied to head.weight (one tensor), which colwise_rep splits along "
                   "dim 0, but embed is not in the plan; split both alike (a tied embedding and head: vocab and "
                   "colwise_rep) or untie them."), msg
    assert check_plan(Net(tied=True), {"head": "colwise_rep", "embed": "vocab"}, 2)


def test_a_style_on_the_wrong_kind_of_module_is_refused():
    assert _refused({"embed": "colwise"}).startswith("the TP plan: embed is a Embedding, but colwise splits an "
                                                     "nn.Linear; give it another style")
    assert "but vocab splits an nn.Embedding" in _refused({"head": "vocab"})
    assert _refused({"blocks.*.up": "colwise", "blocks.0.up": "rowwise"}).startswith(
        "the TP plan gives blocks.0.up two styles ('blocks.*.up': colwise; 'blocks.0.up': rowwise)")


def test_a_layer_whose_forward_bypasses_torchs_or_already_split_is_refused():
    class Scaled(nn.Linear):  # its own forward through torch's: split around it (Gemma's scaled embedding)
        def forward(self, x):
            return super().forward(x) * 2

    class Bypass(nn.Linear):  # its own forward, not through nn.Linear.forward: the split one would not run
        def forward(self, x):
            return F.linear(x, self.weight * 2, self.bias)

    class Plain(nn.Linear):  # its own class, torch's forward: split as a subclass of itself
        pass

    model = Net()
    model.blocks[0].up = Bypass(8, 12)
    model.blocks[1].up = Plain(8, 12)
    msg = _refused({"blocks.0.up": "colwise"}, model)
    assert msg.startswith("the TP plan: blocks.0.up is a Bypass, whose forward is its own rather than nn.Linear's"), msg
    scaled = Net()
    scaled.blocks[0].up = Scaled(8, 12)
    ids = torch.randint(0, 16, (2, 5))
    expected = scaled(ids)
    apply_plan(scaled, {"blocks.0.up": "colwise", "blocks.0.down": "rowwise"}, None)
    assert type(scaled.blocks[0].up).__name__ == "ColwiseLinearScaled" and torch.equal(scaled(ids), expected)
    apply_plan(model, {"blocks.1.up": "colwise", "blocks.1.down": "rowwise"}, None)
    assert isinstance(model.blocks[1].up, Plain) and type(model.blocks[1].up).__name__ == "ColwiseLinearPlain"
    assert "is split already" in _refused({"blocks.1.up": "colwise"}, model)
    model.head = ColumnParallelLinear(8, 16, bias=False)
    assert "is split already (a hybrid.tp layer" in _refused({"head": "colwise"}, model)


def test_an_embedding_with_per_row_statistics_is_refused():
    model = Net()
    model.embed = nn.Embedding(16, 8, max_norm=1.0)
    assert "an nn.Embedding with max_norm, which a table split by rows cannot" in _refused({"embed": "vocab"}, model)


# ---------------------------------------------------------------------------------------- Hugging Face


def _llama(heads=4, kv=2, tied=False, vocab=64, intermediate=64):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=8 * heads, intermediate_size=intermediate,
                                   num_hidden_layers=2, num_attention_heads=heads, num_key_value_heads=kv,
                                   tie_word_embeddings=tied)
    with torch.device("meta"):
        return transformers.LlamaForCausalLM(cfg)


def test_a_hugging_face_model_brings_its_own_plan_prefixed_and_mapped():
    model = _llama(tied=True)
    assert hf_plan(model) == {
        "model.embed_tokens": "vocab", "model.layers.*.self_attn.q_proj": "colwise",
        "model.layers.*.self_attn.k_proj": "colwise", "model.layers.*.self_attn.v_proj": "colwise",
        "model.layers.*.self_attn.o_proj": "rowwise", "model.layers.*.mlp.gate_proj": "colwise",
        "model.layers.*.mlp.up_proj": "colwise", "model.layers.*.mlp.down_proj": "rowwise", "lm_head": "colwise_rep"}
    assert hf_plan(model.model) == {k[len("model."):]: s for k, s in hf_plan(model).items() if k != "lm_head"}
    assert hf_plan(nn.Linear(2, 2)) is None
    parallelize(model, None)  # at TP 1: converted and marked
    assert tp_refusal(model, 2) is None and largest_degree(model, 8)[0] == 2
    assert tp_refusal(model, 4) == ("LlamaConfig.num_key_value_heads is 2, which tp=4 does not divide (attention is "
                                    "split by whole heads); use a TP degree that divides 2")


def test_heads_the_degree_does_not_divide_are_one_sentence_naming_the_numbers():
    model = _llama(heads=6, kv=6)  # q_proj's 192 features split 4 ways, but not its 6 heads
    with pytest.raises(ConfigError) as err:
        check_plan(model, hf_plan(model), 4, "LlamaForCausalLM's own TP plan")
    assert str(err.value) == ("LlamaForCausalLM's own TP plan cannot split LlamaForCausalLM 4 ways: "
                              "LlamaConfig.num_attention_heads is 6, which tp=4 does not divide (attention is split "
                              "by whole heads); use a TP degree that divides 6.")
    assert heads_refusal(model.config, 3) is None and heads_refusal(model.config, 2) is None


def test_the_largest_degree_dividing_heads_mlp_and_vocabulary():
    assert largest_tp(_llama(heads=8, kv=8, vocab=64, intermediate=64).config, 8) == 8
    assert largest_tp(_llama(heads=8, kv=2).config, 8) == 2
    assert largest_tp(_llama(heads=8, kv=8, vocab=50, intermediate=64).config, 8) == 2
    assert config_refusal(_llama(kv=4, vocab=50).config, 4) == ("LlamaConfig.vocab_size is 50, which tp=4 does not "
                                                                "divide; use a TP degree that divides 50")
    assert largest_tp(_llama(heads=6, kv=6, intermediate=96).config, 8) == 2


def test_a_model_without_a_plan_of_its_own_is_told_how_to_give_one():
    with pytest.raises(ConfigError, match=r"^Net has no TP plan of its own .*; give one: parallel.tp_plan in the "
                                          r"cluster file, or hybrid.tp.apply_plan\(model, plan, tp_comm\)\.$"):
        parallelize(Net(), None)


# ---------------------------------------------------------------------------------------- empty_init


class _Rotary(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 6)
        self.register_buffer("inv_freq", 1.0 / 10.0 ** (torch.arange(4.0) / 4), persistent=False)


def test_empty_init_puts_parameters_on_meta_and_computes_buffers():
    with hybrid.empty_init():
        model = _Rotary()
    assert model.fc.weight.is_meta and model.fc.bias.is_meta and isinstance(model.fc.weight, nn.Parameter)
    assert torch.equal(model.inv_freq, _Rotary().inv_freq)
    assert not nn.Linear(2, 2).weight.is_meta  # the patch is gone after the block
    hybrid.materialize(model, seed=1)
    with torch.device("meta"):
        reference = _Rotary()
    reference.inv_freq = _Rotary().inv_freq
    hybrid.materialize(reference, seed=1)
    assert torch.equal(model.fc.weight, reference.fc.weight)


def test_a_meta_buffer_no_init_computes_names_empty_init():
    with torch.device("meta"):
        model = _Rotary()
    with pytest.raises(ConfigError) as err:
        hybrid.materialize(model, seed=1)
    assert str(err.value) == ("buffer 'inv_freq' is on the meta device and its module (_Rotary) has no "
                              "reset_parameters() to initialize it; pass init_fn=, attach a hybrid.weights.init "
                              "initializer, or build the model under hybrid.empty_init() instead of "
                              "torch.device('meta') (parameters on meta, buffers computed as usual).")
