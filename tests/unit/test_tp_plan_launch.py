"""The launcher and TP plans, without Ray: ``parallel.tp_plan`` in the cluster file, a Hugging Face model's own
plan, and the ``hf:`` model config (a transformers model without code). What the plan picks and why, and the
one-sentence refusals, before any rank starts."""

import dataclasses
from pathlib import Path

import pytest

from hybrid.errors import ConfigError
from launch.job.driver import settings_for
from launch.planning.plan import build_plan
from launch.spec import load_spec, parse_spec

ROOT = Path(__file__).resolve().parents[2]
OWN = ROOT / "examples" / "own_model"


def _own(tmp_path, tp_plan, tp="auto", entrypoint="my_model:train", config=None):
    return parse_spec({
        "cluster": {"address": "local", "nodes": 2, "gpus_per_node": 2, "gpu_memory_gb": 80},
        "job": {"entrypoint": entrypoint, "config": str(config or OWN / "model.yaml"), "steps": 3,
                "working_dir": str(OWN)},
        "parallel": {"tp": tp, "precision": "fp32", "tp_plan": tp_plan},
    }, base_dir=ROOT)


def _refused(fn, *args) -> str:
    with pytest.raises(ConfigError) as err:
        fn(*args)
    return str(err.value)


def _at_tp(spec, tp):
    return dataclasses.replace(spec, parallel=dataclasses.replace(spec.parallel, tp=tp))


def _offers(lp, default_reason):
    """tp: auto's default degree is the plan's, or the time model found another faster and says so beside it (a
    profiled model's layouts are weighed at every TP degree its plan splits, as the built-in GPT's)."""
    return lp.tp_reason == default_reason or f"(the default, {default_reason}, is " in lp.tp_reason


def test_the_own_model_example_with_a_tp_plan_is_planned_at_tp_2_and_the_ranks_get_the_plan():
    spec = load_spec(OWN / "cluster-tp.yaml")
    assert spec.parallel.tp_plan == {"embed": "vocab", "blocks.*.up": "colwise", "blocks.*.down": "rowwise",
                                     "out": "colwise_rep"}
    lp = build_plan(_at_tp(spec, None))  # tp: auto (the example pins tp: 2)
    assert lp.tensor_parallel_layers is True and {c.layout.tp for c in lp.time.ranking.candidates} == {1, 2}
    assert _offers(lp, "tp auto: 2 = gpus_per_node, since parallel.tp_plan splits the model"), lp.tp_reason
    lp = build_plan(_at_tp(spec, 2))
    assert (lp.layout.tp, lp.layout.dp) == (2, 2) and settings_for(lp).tp_plan == spec.parallel.tp_plan


def test_a_tp_plan_that_does_not_fit_the_model_is_one_sentence_before_anything_starts(tmp_path):
    msg = _refused(build_plan, _own(tmp_path, {"blocks.*.fc1": "colwise"}))
    assert msg == ("parallel.tp_plan['blocks.*.fc1'] matches no module of TinyLM (its layers are named like embed, "
                   "blocks.0.up, blocks.0.down); correct the pattern or remove it."), msg
    odd = tmp_path / "model.yaml"  # a vocabulary of 63 rows: no split in two
    odd.write_text("model: {vocab_size: 63, hidden: 32, layers: 2, seq_len: 16}\ntrain: {lr: 0.01}\n")
    msg = _refused(build_plan, _own(tmp_path, {"embed": "vocab"}, tp=2, config=odd))
    assert msg == ("parallel.tp=2 cannot split this model: embed (vocab) has num_embeddings=63, not divisible by 2; "
                   "set parallel.tp to a divisor of gpus_per_node that works, or auto."), msg
    lp = build_plan(_own(tmp_path, {"embed": "vocab"}, config=odd))
    assert lp.layout.tp == 1 and lp.tp_reason == (
        "tp auto: 1, the largest divisor of gpus_per_node=2 that splits the model by parallel.tp_plan (tp 2: embed "
        "(vocab) has num_embeddings=63, not divisible by 2)")


def test_a_tp_plan_for_a_model_split_already_is_refused():
    spec = parse_spec({
        "cluster": {"address": "local", "nodes": 2, "gpus_per_node": 2, "gpu_memory_gb": 80},
        "job": {"entrypoint": "hybrid.models.gpt:train", "config": "configs/gpt-tiny.yaml", "steps": 3},
        "parallel": {"tp_plan": {"blocks.*.mlp.fc": "colwise"}},
    }, base_dir=ROOT)
    assert _refused(build_plan, spec).startswith(
        "parallel.tp_plan is set, but hybrid.models.gpt.training.build_model returns a GPT with tensor-parallel "
        "parameters already")


@pytest.mark.parametrize("plan, expected", [
    ({"blocks.*.up": "sharded"}, "parallel.tp_plan['blocks.*.up'] is 'sharded', which is not a TP style hybrid "
                                 "implements; use one of colwise, colwise_rep, rowwise"),
    ("colwise", "parallel.tp_plan must be 'own' (the model's own Hugging Face plan) or a mapping like "
                "{'layers.*.mlp.up_proj': colwise, "),
    ({}, "parallel.tp_plan is empty; give module-name patterns and their styles"),
])
def test_parallel_tp_plan_is_checked_when_the_cluster_file_is_read(tmp_path, plan, expected):
    assert _refused(_own, tmp_path, plan).startswith(expected)


# ------------------------------------------------------------------------------------- hf: model configs

transformers = pytest.importorskip("transformers")


def _hf_job(tmp_path, heads=4, kv=2, model_yaml="hf: {config: tiny/config.json, seq_len: 16}\n", nodes=2, gpus=2,
            tp="auto", plan=None):
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=8 * heads, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=heads, num_key_value_heads=kv,
                                      max_position_embeddings=32)
    if plan is not None:
        config.base_model_tp_plan = plan
    config.save_pretrained(tmp_path / "tiny")
    (tmp_path / "model.yaml").write_text(model_yaml)
    return parse_spec({
        "cluster": {"address": "local", "nodes": nodes, "gpus_per_node": gpus, "gpu_memory_gb": 80},
        "job": {"entrypoint": "hybrid.models.hf:train", "config": "model.yaml", "steps": 3},
        "parallel": {"tp": tp, "precision": "fp32"},
    }, base_dir=tmp_path)


def test_a_hugging_face_model_config_gets_tp_from_its_own_plan(tmp_path):
    lp = build_plan(_hf_job(tmp_path))
    assert _offers(lp, "tp auto: 2 = gpus_per_node, since LlamaForCausalLM's own TP plan splits the model")
    assert (build_plan(_hf_job(tmp_path, tp=2)).layout.dp) == 2
    assert lp.params_source == "counted on the meta device by hybrid.models.hf.build_model"
    lp = build_plan(_hf_job(tmp_path, nodes=1, gpus=8))
    assert lp.layout.tp in (2, 1) and {c.layout.tp for c in lp.time.ranking.candidates} == {2, 1}
    assert _offers(lp, "tp auto: 2, the largest divisor of gpus_per_node=8 that splits the model by LlamaForCausalLM's "
                       "own TP plan (tp 8: LlamaConfig.num_attention_heads is 4, which tp=8 does not divide (attention "
                       "is split by whole heads); use a TP degree that divides 4)"), lp.tp_reason
    assert _refused(build_plan, _hf_job(tmp_path, nodes=1, gpus=8, tp=4)) == (
        "parallel.tp=4 cannot split this model: LlamaConfig.num_key_value_heads is 2, which tp=4 does not divide "
        "(attention is split by whole heads); use a TP degree that divides 2; set parallel.tp to a divisor of "
        "gpus_per_node that works, or auto.")
    # through the built-in GPT's entrypoint too
    spec = _hf_job(tmp_path)
    lp = build_plan(parse_spec({"cluster": {"address": "local", "nodes": 2, "gpus_per_node": 2, "gpu_memory_gb": 80},
                                "job": {"entrypoint": "hybrid.models.gpt:train", "config": str(spec.job.config),
                                        "steps": 3}}, base_dir=tmp_path))
    assert "tp auto: 2 = gpus_per_node, since LlamaForCausalLM's own TP plan" in lp.tp_reason
    assert lp.figures.plain.model == "LlamaForCausalLM" and lp.figures.seq == 16  # profiled from its config


ENTRYPOINT = """
import torch, transformers

def build_model(model_config, tp_comm=None):
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2)
    if model_config.get("plan"):
        config.base_model_tp_plan = model_config["plan"]
    return transformers.LlamaForCausalLM(config)

def train(ctx):
    pass
"""


def _own_hf(tmp_path, plan=None, tp="auto", name="my_hf", tp_plan="own"):
    (tmp_path / f"{name}.py").write_text(ENTRYPOINT)
    (tmp_path / "model.yaml").write_text(f"plan: {plan or {}}\n")
    parallel = {"tp": tp, "precision": "fp32", **({"tp_plan": tp_plan} if tp_plan else {})}
    return parse_spec({
        "cluster": {"address": "local", "nodes": 2, "gpus_per_node": 2, "gpu_memory_gb": 80},
        "job": {"entrypoint": f"{name}:train", "config": "model.yaml", "steps": 3},
        "parallel": parallel,
    }, base_dir=tmp_path)


def test_a_hugging_face_model_of_ones_own_entrypoint_is_planned_by_its_own_plan(tmp_path):
    lp = build_plan(_own_hf(tmp_path, name="my_hf_a"))
    assert lp.layout.tp == 2 and lp.tp_reason == ("tp auto: 2 = gpus_per_node, since LlamaForCausalLM's own TP plan "
                                                  "splits the model")


def test_an_own_entrypoint_gets_its_models_own_plan_only_when_it_says_it_applies_it(tmp_path):
    # an entrypoint that never calls ctx.parallelize must not be planned at TP > 1 (it ran at TP 1 before plans)
    lp = build_plan(_own_hf(tmp_path, name="my_hf_d", tp_plan=None))
    assert lp.layout.tp == 1 and "set parallel.tp_plan: own and call ctx.parallelize(model)" in lp.tp_reason, \
        lp.tp_reason
    (tmp_path / "plain_model.py").write_text("import torch\n\ndef build_model(model_config):\n"
                                             "    return torch.nn.Linear(8, 8)\n\ndef train(ctx):\n    pass\n")
    no_plan = {"cluster": {"address": "local", "nodes": 2, "gpus_per_node": 2, "gpu_memory_gb": 80},
               "job": {"entrypoint": "plain_model:train", "config": "model.yaml", "steps": 3},
               "parallel": {"tp_plan": "own"}}
    assert "has no TP plan of its own" in _refused(build_plan, parse_spec(no_plan, base_dir=tmp_path))


def test_a_model_whose_own_plan_cannot_be_used_runs_at_tp_1_and_says_why(tmp_path):
    plan = {"layers.*.self_attn.q_proj": "colwise", "layers.*.input_layernorm": "sequence_parallel"}
    lp = build_plan(_own_hf(tmp_path, plan, name="my_hf_b", tp_plan=None))
    assert lp.layout.tp == 1 and lp.tp_reason.startswith(
        "tp auto: 1, since the model has no tensor-parallel layers and its own TP plan cannot be used "
        "(LlamaForCausalLM's own TP plan['model.layers.*.input_layernorm'] is 'sequence_parallel', which is not a "
        "TP style hybrid implements;"), lp.tp_reason
    assert "(its own TP plan cannot be used: " in _refused(build_plan, _own_hf(tmp_path, plan, tp=2, name="my_hf_c",
                                                                              tp_plan=None))
    asked = _refused(build_plan, _own_hf(tmp_path, plan, name="my_hf_e"))  # parallel.tp_plan: own, explicitly
    assert "is 'sequence_parallel', which is not a TP style hybrid implements" in asked, asked


@pytest.mark.parametrize("model_yaml, expected", [
    ("hf: {config: tiny/config.json, seq_len: 16}\nmodel: {vocab_size: 64}\n",
     "has both model: (the built-in GPT's shape) and hf: (a transformers model); keep the one to train."),
    ("hf: {config: nowhere/config.json, seq_len: 16}\n", "nowhere/config.json', which is not a file; give the path "
                                                         "of a transformers config.json"),
    ("hf: {config: tiny, seq_len: 32}\n", "hf.seq_len is 32, but a row of seq_len + 1 tokens does not fit the "
                                          "model's max_position_embeddings (32); use at most 31."),
    ("hf: {config: tiny, seq_len: 16, tokenizer: x}\n", "hf.tokenizer is not a known setting; use one of: config, "
                                                        "weights, seq_len."),
    ("hf: {config: tiny}\n", "hf.seq_len is missing; add it (tokens per row, e.g. 128)."),
])
def test_an_hf_model_config_is_checked_in_one_sentence_before_anything_starts(tmp_path, model_yaml, expected):
    msg = _refused(build_plan, _hf_job(tmp_path, model_yaml=model_yaml))
    assert expected in msg, msg
