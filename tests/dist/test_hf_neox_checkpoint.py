"""A GPT-NeoX checkpoint in transformers' own keys, in and out, on 2 real gloo ranks.

A tiny Pythia-shaped GPT-NeoX saved by ``save_pretrained`` in several shards holds its head as
``embed_out.weight`` (the module is ``lm_head``). Built on meta on each rank and loaded with ``weights=DIR``
at ZeRO stage 3, DP 2, its first loss is the single-process loss of ``from_pretrained(DIR)``; after two
steps the run is saved, and ``consolidate_hf`` (what ``hybrid checkpoint consolidate RUN --hf OUT`` calls)
writes the keys save_pretrained writes, so ``from_pretrained(OUT)`` loads with nothing missing or unexpected
and holds exactly the engine's ``full_state_dict()``.
"""

import json

import pytest
import torch
import torch.distributed as dist

import hybrid
from hybrid import checkpoint
from hybrid.checkpoint import consolidate_hf
from hybrid.runtime.local_launch import run_local
from hybrid.weights.files import INDEX

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.slow

WORLD, ROWS, SEQ = 2, 4, 16
NEOX = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
            max_position_embeddings=32, tie_word_embeddings=False)


def _ids(step: int) -> torch.Tensor:
    return torch.randint(0, NEOX["vocab_size"], (ROWS, SEQ), generator=torch.Generator().manual_seed(step))


def _ranks(neox_dir: str, run_dir: str):
    rank = dist.get_rank()
    rows = slice(rank * ROWS // WORLD, (rank + 1) * ROWS // WORLD)
    config = transformers.GPTNeoXConfig(**NEOX)
    with hybrid.empty_init():
        model = transformers.GPTNeoXForCausalLM(config)
    engine = hybrid.initialize(model, {"zero_optimization": {"stage": 3}, "precision": "fp32",
                                       "optimizer": {"type": "SGD", "params": {"lr": 0.5}}}, weights=neox_dir)
    out = {}
    for step in range(2):
        ids = _ids(step)[rows]
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        if step == 0:
            mean = loss.detach().clone()
            dist.all_reduce(mean)  # every rank holds as many tokens: the mean of the means is the batch's
            out["first_loss"] = mean.item() / WORLD
    with open(f"{neox_dir}/config.json") as f:  # as save_pretrained wrote it (architectures included)
        checkpoint.save(run_dir, engine, 2, model_config=json.load(f))
    full = engine.full_state_dict()
    out["trained"] = full if rank == 0 else None
    return out


def test_a_neox_loads_from_its_own_keys_trains_and_is_written_in_them(tmp_path):
    neox_dir, run_dir, out_dir = tmp_path / "neox", tmp_path / "run", tmp_path / "hf"
    torch.manual_seed(0)
    source = transformers.GPTNeoXForCausalLM(transformers.GPTNeoXConfig(**NEOX))
    source.save_pretrained(neox_dir, max_shard_size="20KB")
    keys = json.loads((neox_dir / INDEX).read_text())["weight_map"]
    assert len(set(keys.values())) >= 3 and "embed_out.weight" in keys and "lm_head.weight" not in keys

    results = run_local(_ranks, WORLD, str(neox_dir), str(run_dir), timeout_s=120)

    with torch.no_grad():
        expected = source(input_ids=_ids(0), labels=_ids(0)).loss.item()
    for r in results:
        assert abs(r["first_loss"] - expected) <= 1e-5 * abs(expected), (r["first_loss"], expected)

    done = consolidate_hf(run_dir, out_dir, max_shard_size="20KB")
    assert done.names_from == "GPTNeoXForCausalLM"
    assert json.loads((out_dir / INDEX).read_text())["weight_map"].keys() == keys.keys()
    loaded, info = transformers.GPTNeoXForCausalLM.from_pretrained(out_dir, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    trained, state = results[0]["trained"], loaded.state_dict()
    assert trained.keys() == state.keys()
    for name, value in trained.items():
        assert torch.equal(state[name], value), name
    assert not torch.equal(trained["lm_head.weight"], source.state_dict()["lm_head.weight"]), \
        "training must move the head"
