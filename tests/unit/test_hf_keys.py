"""Checkpoint keys as transformers has them (``hybrid.weights.hf_keys``), in one process.

A tiny Pythia-shaped GPT-NeoX (its head module ``lm_head``, its checkpoints' key ``embed_out.weight``):
``save_pretrained`` in several shards, or in one ``model.safetensors`` named as a file, loads into a meta-built
NeoX (``hybrid.materialize``) as exactly the saved model; a checkpoint of the base model loads into the causal
LM with the base-model prefix added, as from_pretrained loads it. A missing head, a wrongly shaped tensor, two
keys for one tensor and a key transformers converts rather than renames (Mixtral's per-expert tensors) are
each one sentence naming the file's key. Out: ``consolidate_hf`` of a NeoX checkpoint writes the keys
save_pretrained writes and from_pretrained loads it exactly; of a Mixtral it writes the model's own names (as
``save_original_format=False``), which from_pretrained loads with nothing missing. Llama and any other
``nn.Module`` keep their names, and ``hybrid.weights`` imports without transformers.
"""

from __future__ import annotations

import importlib.util
import json
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint import FileSystemWriter

import hybrid
from hybrid.checkpoint import consolidate_hf, integrity, layout, manifest
from hybrid.checkpoint.agreement import record_checksums
from hybrid.checkpoint.flat_planner import FlatSavePlanner
from hybrid.comm.collectives import Comm
from hybrid.errors import CheckpointError
from hybrid.models.gpt.model import GPT, GPTConfig
from hybrid.weights.files import INDEX, SINGLE
from hybrid.weights.hf_keys import checkpoint_keys, model_names

transformers = pytest.importorskip("transformers")

NEOX = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
            max_position_embeddings=32, tie_word_embeddings=False)
MIXTRAL = dict(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
               intermediate_size=16, num_local_experts=2, max_position_embeddings=32, tie_word_embeddings=False)
LLAMA = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=64, max_position_embeddings=32, tie_word_embeddings=True)


def _neox(seed: int = 0):
    torch.manual_seed(seed)
    return transformers.GPTNeoXForCausalLM(transformers.GPTNeoXConfig(**NEOX))


def _meta(cls, config):
    with hybrid.empty_init():
        return cls(config)


def _meta_neox():
    return _meta(transformers.GPTNeoXForCausalLM, transformers.GPTNeoXConfig(**NEOX))


def _keys(directory: Path) -> set:
    """The tensor keys of a save_pretrained directory."""
    if (directory / INDEX).is_file():
        return set(json.loads((directory / INDEX).read_text())["weight_map"])
    return set(load_file(str(directory / SINGLE)))


def _same(actual: dict, expected: dict) -> None:
    assert actual.keys() == expected.keys()
    for name, value in expected.items():
        assert actual[name].dtype == value.dtype and torch.equal(actual[name], value), name


def _one_line(err: pytest.ExceptionInfo, *parts) -> str:
    message = str(err.value)
    assert "\n" not in message and len(message) < 500, message
    for part in parts:
        assert part in message, (part, message)
    return message


def test_neox_keys_both_ways_and_other_models_keep_their_names():
    model = _meta_neox()
    saved = checkpoint_keys(model)
    assert saved.keys() == model.state_dict().keys()
    assert {n: k for n, k in saved.items() if n != k} == {"lm_head.weight": "embed_out.weight"}
    assert model_names(model, saved.values()) == {k: n for n, k in saved.items()}
    # a checkpoint of the base model (no gpt_neox. prefix) loads into the causal LM with the prefix added
    base = _meta(transformers.GPTNeoXModel, transformers.GPTNeoXConfig(**NEOX))
    loaded = model_names(model, checkpoint_keys(base).values())
    assert loaded == {k: f"gpt_neox.{k}" for k in base.state_dict()}

    llama = _meta(transformers.LlamaForCausalLM, transformers.LlamaConfig(**LLAMA))
    names = list(llama.state_dict())
    assert "lm_head.weight" in names  # the tied alias is a name like any other
    assert checkpoint_keys(llama) == {n: n for n in names} and model_names(llama, names) == {n: n for n in names}
    gpt = GPT(GPTConfig(vocab_size=64, seq_len=16, hidden=32, n_layers=2, n_heads=4), device="meta")
    own = {n: n for n in gpt.state_dict()}
    assert checkpoint_keys(gpt) == own and model_names(gpt, ["embed_out.weight", *own]) == \
        {"embed_out.weight": "embed_out.weight", **own}


def test_a_sharded_save_pretrained_neox_materializes_exactly(tmp_path):
    source = _neox(1)
    source.save_pretrained(tmp_path, max_shard_size="20KB")
    assert len(list(tmp_path.glob("model-*.safetensors"))) >= 3
    keys = _keys(tmp_path)
    assert "embed_out.weight" in keys and "lm_head.weight" not in keys
    assert keys == set(checkpoint_keys(source).values())  # what save_pretrained wrote, asked of the model
    model = hybrid.materialize(_meta_neox(), weights=tmp_path)
    _same(model.state_dict(), source.state_dict())


def test_a_single_safetensors_file_of_save_pretrained_materializes_exactly(tmp_path):
    source = _neox(2)
    source.save_pretrained(tmp_path, max_shard_size="1GB")
    assert not (tmp_path / INDEX).exists() and "embed_out.weight" in _keys(tmp_path)
    model = hybrid.materialize(_meta_neox(), weights=tmp_path / SINGLE)  # the file itself, not the directory
    _same(model.state_dict(), source.state_dict())


def test_a_base_model_checkpoint_loads_with_the_prefix_added(tmp_path):
    torch.manual_seed(3)
    base = transformers.GPTNeoXModel(transformers.GPTNeoXConfig(**NEOX))
    state = dict(base.state_dict())
    state["embed_out.weight"] = torch.randn(NEOX["vocab_size"], NEOX["hidden_size"])
    save_file(state, str(tmp_path / "base.safetensors"))
    model = hybrid.materialize(_meta_neox(), weights=tmp_path / "base.safetensors")
    expected = {f"gpt_neox.{k}": v for k, v in base.state_dict().items()}
    _same(model.state_dict(), {**expected, "lm_head.weight": state["embed_out.weight"]})


def test_what_cannot_be_mapped_or_matched_is_one_sentence_naming_the_key(tmp_path):
    state = _neox(4).state_dict()
    on_disk = {("embed_out.weight" if k == "lm_head.weight" else k): v for k, v in state.items()}
    cases = {
        "missing": ({k: v for k, v in on_disk.items() if k != "embed_out.weight"},
                    ["has no tensor 'embed_out.weight', which the model needs"]),
        "shape": ({**on_disk, "embed_out.weight": torch.zeros(3, 32)},
                  ["holds 'embed_out.weight' with shape [3, 32] but the model's is [64, 32]"]),
        "both": ({**on_disk, "lm_head.weight": state["lm_head.weight"].clone()},
                 ["holds both 'embed_out.weight' and 'lm_head.weight'", "the same tensor 'lm_head.weight'"]),
        "extra": ({**on_disk, "gpt_neox.extra.weight": torch.zeros(2)},
                  ["has a tensor 'gpt_neox.extra.weight' that the model does not have"]),
    }
    for name, (tensors, parts) in cases.items():
        path = tmp_path / f"{name}.safetensors"
        save_file(tensors, str(path))
        with pytest.raises(CheckpointError) as err:
            hybrid.materialize(_meta_neox(), weights=path)
        _one_line(err, str(path), *parts)

    mixtral = transformers.MixtralConfig(**MIXTRAL)
    torch.manual_seed(5)
    transformers.MixtralForCausalLM(mixtral).save_pretrained(tmp_path / "mixtral")  # experts one by one
    with pytest.raises(CheckpointError) as err:
        hybrid.materialize(_meta(transformers.MixtralForCausalLM, mixtral), weights=tmp_path / "mixtral")
    _one_line(err, str(tmp_path / "mixtral"), "'model.layers.0.block_sparse_moe.experts.0.w1.weight'",
              "'model.layers.0.mlp.experts.gate_up_proj'", "MergeModulelist", "not by a rename",
              "save_original_format=False")


def test_hybrid_weights_imports_without_transformers(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # `import transformers` raises ImportError
    for name in ("hybrid.weights.hf_keys", "hybrid.weights.files", "hybrid.weights.sources", "hybrid.weights"):
        spec = importlib.util.find_spec(name)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)  # a fresh copy, the package's own left in place
        if name.endswith("hf_keys"):
            net = torch.nn.Linear(2, 3)
            assert module.model_names(net, ["weight", "x"]) == {"weight": "weight", "x": "x"}
            assert module.checkpoint_keys(net) == {"weight": "weight", "bias": "bias"}


# -- out ------------------------------------------------------------------------------------------------
def _checkpoint(run: Path, model: torch.nn.Module, step: int = 3) -> Path:
    """``model``'s state dict as a one-rank fp32 checkpoint (as ``sharded.save`` writes it: every parameter a
    trainable master, with its moments; tied names as aliases), its config as the model config."""
    first, aliases, specs, state, pieces = {}, {}, {}, {}, {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        if first.setdefault(id(tensor), name) != name:
            aliases[name] = first[id(tensor)]
            continue
        specs[name] = {"shape": list(tensor.shape), "tp_dim": None}
        for kind in manifest.KINDS:
            key = manifest.tensor_key(kind, 0, name)
            state[key] = tensor.detach().float().reshape(-1).clone()
            pieces[key] = (0, tensor.numel())
    tmp = layout.temporary_dir(run, step)
    tmp.mkdir(parents=True)
    planner = FlatSavePlanner(pieces)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        metadata = dcp.save(state, storage_writer=FileSystemWriter(tmp), planner=planner, no_dist=True)
    doc = manifest.build(step=step, optimizer_step_count=step, global_step=step,
                         world={"world_size": 1, "dp": 1, "tp": 1, "stage": 0, "precision": "fp32"},
                         params=dict(sorted(specs.items())), aliases=aliases, model_config=model.config.to_dict())
    doc["files"] = record_checksums(tmp, metadata, planner.final_plan.items, Comm(None), "cpu")
    manifest.write(tmp, doc)
    final = layout.final_dir(run, step)
    layout.publish(tmp, final, integrity.seal_text(tmp, final.name))
    return final


def test_consolidate_hf_writes_the_keys_save_pretrained_writes(tmp_path):
    source = _neox(6)
    source.save_pretrained(tmp_path / "pretrained", max_shard_size="20KB")
    _checkpoint(tmp_path / "run", source)
    done = consolidate_hf(tmp_path / "run", tmp_path / "hf", max_shard_size="20KB")
    assert done.names_from == "GPTNeoXForCausalLM" and len(done.shards) >= 3
    assert _keys(tmp_path / "hf") == _keys(tmp_path / "pretrained")
    loaded, info = transformers.GPTNeoXForCausalLM.from_pretrained(tmp_path / "hf", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    _same(loaded.state_dict(), source.state_dict())
    _same(hybrid.materialize(_meta_neox(), weights=tmp_path / "hf").state_dict(), source.state_dict())

    # a model transformers would convert on save: written in its own names, which from_pretrained loads as they are
    torch.manual_seed(7)
    mixtral = transformers.MixtralForCausalLM(transformers.MixtralConfig(**MIXTRAL))
    _checkpoint(tmp_path / "moe", mixtral)
    done = consolidate_hf(tmp_path / "moe", tmp_path / "moe-hf")
    assert done.names_from == "MixtralForCausalLM" and _keys(tmp_path / "moe-hf") == set(mixtral.state_dict())
    loaded, info = transformers.MixtralForCausalLM.from_pretrained(tmp_path / "moe-hf", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    _same(loaded.state_dict(), mixtral.state_dict())
