"""Hugging Face checkpoints in and out, in one process.

In: a ``save_pretrained``-style directory (sharded safetensors and ``model.safetensors.index.json``, written
here by huggingface_hub's own writer, in bf16) loads with ``weights=DIR`` as its fp32 values; a reader maps
only the shard it is reading; a broken index or a missing, truncated or short shard is one sentence.
Out: ``hybrid.checkpoint.consolidate_hf`` and ``hybrid checkpoint consolidate --hf`` cut shards as
save_pretrained does, write the index and the model's config.json, read back equal to ``consolidate``, and
refuse a bad OUT_DIR, a damaged checkpoint or a non-finite weight before leaving anything behind. The
multi-rank load and the transformers round trip are in tests/dist/test_hf_checkpoints.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import hybrid
from hybrid.checkpoint import consolidate, consolidate_hf, hf_export, layout
from hybrid.errors import CheckpointError
from hybrid.models.gpt.model import GPT, GPTConfig
from hybrid.weights.files import INDEX, ShardedSafetensors, open_weights
from launch.cli import main
from tests.unit import test_checkpoint_offline as saved
from tests.unit.test_checkpoint_integrity import _refused, _truncate

huggingface_hub = pytest.importorskip("huggingface_hub")

TINY = GPTConfig(vocab_size=64, seq_len=16, hidden=32, n_layers=2, n_heads=4)


def _save_pretrained(directory: Path, max_shard_size="10KB") -> dict:
    """A tiny GPT's weights in bf16, sharded by huggingface_hub (as save_pretrained shards); the fp32 values
    a reader must give back."""
    state = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in GPT(TINY, seed=3).state_dict().items()}
    directory.mkdir(exist_ok=True)
    huggingface_hub.save_torch_state_dict(state, directory, max_shard_size=max_shard_size)
    return {k: v.float() if v.is_floating_point() else v for k, v in state.items()}


def _one_line(err: pytest.ExceptionInfo, *names) -> str:
    message = str(err.value)
    assert "\n" not in message and len(message) < 400, message
    for name in names:
        assert str(name) in message, (name, message)
    return message


def test_a_sharded_bf16_directory_loads_as_its_fp32_values(tmp_path):
    expected = _save_pretrained(tmp_path / "hf")
    shards = sorted(p.name for p in (tmp_path / "hf").glob("*.safetensors"))
    assert len(shards) >= 3 and (tmp_path / "hf" / INDEX).is_file()
    for weights in (tmp_path / "hf", tmp_path / "hf" / INDEX):  # the directory, or its index named
        loaded = hybrid.materialize(GPT(TINY, device="meta"), weights=weights).state_dict()
        assert loaded.keys() == expected.keys()
        for name, value in expected.items():
            assert loaded[name].dtype == torch.float32 and torch.equal(loaded[name], value), name
    (tmp_path / "one").mkdir()
    huggingface_hub.save_torch_state_dict(GPT(TINY, seed=4).state_dict(), tmp_path / "one")  # fits one file
    assert sorted(p.name for p in (tmp_path / "one").iterdir()) == ["model.safetensors"]
    loaded = hybrid.materialize(GPT(TINY, device="meta"), weights=tmp_path / "one")
    assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), GPT(TINY, seed=4).state_dict().values()))


def _mapped(directory: Path) -> set:
    """Names of the files under ``directory`` this process has mapped now."""
    with open("/proc/self/maps") as maps:
        return {Path(line.split(None, 5)[5].strip()).name for line in maps
                if len(line.split(None, 5)) == 6 and line.split(None, 5)[5].startswith(str(directory))}


def test_a_reader_maps_only_the_shard_it_reads(tmp_path):
    _save_pretrained(tmp_path)
    where = json.loads((tmp_path / INDEX).read_text())["weight_map"]
    first, last = where["tok_emb.weight"], where["ln_f.weight"]
    assert first != last
    weights = open_weights(tmp_path)
    assert isinstance(weights, ShardedSafetensors) and _mapped(tmp_path) == set()  # headers read, then closed
    weights.read("tok_emb.weight", 0, 5)
    assert _mapped(tmp_path) == {first}
    weights.read("ln_f.weight", 3, 9)
    assert _mapped(tmp_path) == {last}
    weights.close()
    assert _mapped(tmp_path) == set()


def test_a_broken_directory_is_one_sentence(tmp_path):
    good = tmp_path / "good"
    _save_pretrained(good)
    index = json.loads((good / INDEX).read_text())
    shard = index["weight_map"]["ln_f.weight"]
    other = index["weight_map"]["tok_emb.weight"]

    def broken(name: str, change) -> Path:
        directory = tmp_path / name
        directory.mkdir()
        for f in good.iterdir():
            (directory / f.name).write_bytes(f.read_bytes())
        change(directory)
        return directory

    def edit_index(d: Path, weight_map=None, text=None):
        (d / INDEX).write_text(text if text is not None else json.dumps({**index, "weight_map": weight_map}))

    cases = [
        (broken("missing", lambda d: (d / shard).unlink()), [INDEX, shard, "does not exist"]),
        (broken("renamed", lambda d: edit_index(d, {**index["weight_map"], "ln_f.weight": "model-x.safetensors"})),
         [INDEX, "'ln_f.weight'", "model-x.safetensors", "does not exist"]),
        (broken("moved", lambda d: edit_index(d, {**index["weight_map"], "ln_f.weight": other})),
         [INDEX, "'ln_f.weight'", other, "does not hold it"]),
        (broken("not-json", lambda d: edit_index(d, text="{\"weight_map\": {")), [INDEX, "not valid JSON"]),
        (broken("no-map", lambda d: edit_index(d, text="{\"metadata\": {}}")), [INDEX, "has no weight_map"]),
        (broken("outside", lambda d: edit_index(d, {**index["weight_map"], "ln_f.weight": "../good/" + shard})),
         [INDEX, "not the name of a file in its directory"]),
        (broken("truncated", lambda d: _truncate(d / shard)), [shard, "cannot be read as safetensors"]),
        (broken("empty", lambda d: [f.unlink() for f in d.iterdir()]), ["is a directory without", INDEX]),
        (broken("short", lambda d: edit_index(d, {k: v for k, v in index["weight_map"].items()
                                                  if k != "ln_f.weight"})),
         ["weights directory", "has no tensor 'ln_f.weight'"]),
    ]
    for path, names in cases:
        with pytest.raises(CheckpointError) as err:
            hybrid.materialize(GPT(TINY, device="meta"), weights=path)
        _one_line(err, path if names[0] != INDEX else path / INDEX, *names)


# -- out ------------------------------------------------------------------------------------------------
def _checkpoint(run: Path, step: int = 5) -> Path:
    """The offline tests' TP-2 checkpoint: w (sliced on dim 1), b, frozen bf16 f (sliced on dim 0), an int64
    buffer, w tied under w_tied; its model config is not a transformers one."""
    return saved._write_checkpoint(run, step)


def test_consolidate_hf_writes_shards_and_an_index_that_read_back(tmp_path):
    run, out = tmp_path / "run", tmp_path / "hf"
    _checkpoint(run)
    # fp32 bytes in name order: b 12, count 8, f 24, w 96 -> [b, count] [f] [w: above the limit, alone]
    done = consolidate_hf(run, out, max_shard_size=40)
    names = [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    assert done.shards == tuple(names) and done.config_from is None
    assert sorted(p.name for p in out.iterdir()) == sorted(names + [INDEX])
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # the temporary was renamed
    index = json.loads((out / INDEX).read_text())
    # parameters: b 3 + w 24 + f 6 (frozen), the buffer not counted, the tied alias once
    assert index == {"metadata": {"total_parameters": 33, "total_size": 140},
                     "weight_map": {"b": names[0], "count": names[0], "f": names[1], "w": names[2]}}
    assert done.parameters == 33 and done.total_size == 140 and done.tensors == 4
    for name, shard in index["weight_map"].items():
        value = load_file(str(out / shard))[name]
        assert torch.equal(value, saved.FULL[name].float() if name == "f" else saved.FULL[name]), name
    assert load_file(str(out / names[1]))["f"].dtype == torch.float32
    state, _, _ = consolidate(run)
    with open_weights(out) as weights:
        for name in ("w", "b", "f", "count"):
            dtype = torch.int64 if name == "count" else torch.float32
            assert torch.equal(weights.read(name, 0, state[name].numel(), dtype), state[name].reshape(-1)), name


def test_config_json_comes_from_the_given_file_or_the_checkpoint(tmp_path, monkeypatch):
    run = tmp_path / "run"
    _checkpoint(run)
    config = {"model_type": "llama", "dtype": "bfloat16", "tie_word_embeddings": True, "hidden_size": 6}
    (tmp_path / "given").mkdir()
    (tmp_path / "given" / "config.json").write_text(json.dumps(config))
    done = consolidate_hf(run, tmp_path / "a", config=tmp_path / "given")  # the directory holding it
    assert done.config_from == str(tmp_path / "given")
    assert json.loads((tmp_path / "a" / "config.json").read_text()) == {**config, "dtype": "float32"}

    of = hf_export.config_of_checkpoint
    assert of({"model_config": {"model": {"hidden": 6}}}) == (None, None)
    assert of({"model_config": config})[0] == config
    assert of({"model_config": {"model": config, "train": {}}})[0] == config
    assert of({"model_config": {"hf": {"config": str(tmp_path / "given"), "seq_len": 8}}})[0] == config
    with pytest.raises(CheckpointError) as err:  # relative to a model config file the manifest does not record
        of({"model_config": {"hf": {"config": "tiny/config.json"}}})
    _one_line(err, "'tiny/config.json'", "--config")

    monkeypatch.setattr(saved, "ALIASES", {})  # a checkpoint without tied tensors
    _checkpoint(tmp_path / "untied")
    with pytest.raises(CheckpointError) as err:
        consolidate_hf(tmp_path / "untied", tmp_path / "b", config=config)
    _one_line(err, "tie_word_embeddings", "no tied tensors")
    assert not (tmp_path / "b").exists()


def test_what_consolidate_hf_refuses_leaves_nothing_behind(tmp_path, monkeypatch):
    run = tmp_path / "run"
    ckpt = _checkpoint(run)
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "tokenizer.json").write_text("{}")
    (tmp_path / "a-file").write_text("x")
    (tmp_path / "bad.json").write_text("{")
    (tmp_path / "plain.json").write_text("{\"hidden\": 6}")
    cases = [
        (dict(out_dir=ckpt / "hf"), "lies inside the checkpoint directory"),
        (dict(out_dir=run / "checkpoints" / "hf"), "lies inside the checkpoint directory"),
        (dict(out_dir=tmp_path / "full"), "a directory with files in it"),
        (dict(out_dir=tmp_path / "a-file"), "it is a file"),
        (dict(out_dir=tmp_path / "a-file" / "hf"), "a parent is not a directory"),
        (dict(out_dir=Path("/proc/hf")), "cannot write the Hugging Face directory /proc/hf"),
        (dict(out_dir=tmp_path / "o", max_shard_size="lots"), "max_shard_size must be a size such as 5GB"),
        (dict(out_dir=tmp_path / "o", config=tmp_path / "bad.json"), "is not valid JSON"),
        (dict(out_dir=tmp_path / "o", config=tmp_path / "plain.json"), "has no model_type"),
        (dict(out_dir=tmp_path / "o", config=tmp_path / "nope.json"), "cannot be read"),
    ]
    for kwargs, pattern in cases:
        with pytest.raises(CheckpointError, match=pattern) as err:
            consolidate_hf(run, **kwargs)
        _one_line(err)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file", "bad.json", "full", "plain.json", "run"]

    monkeypatch.setitem(saved.FULL, "w", torch.full((4, 6), float("inf")))
    _checkpoint(tmp_path / "inf")
    with pytest.raises(CheckpointError, match="non-finite values .* in 'w'"):
        consolidate_hf(tmp_path / "inf", tmp_path / "o", max_shard_size=40)  # w is the last shard written
    data = next(ckpt.glob("*.distcp"))
    _truncate(data)
    with pytest.raises(CheckpointError, match=f"truncated: {data.name}"):
        consolidate_hf(ckpt, tmp_path / "o")
    assert not (tmp_path / "o").exists() and not any(p.name.startswith(".") for p in tmp_path.iterdir())


def test_cli_consolidate_hf(tmp_path, capsys):
    run = tmp_path / "run"
    ckpt = _checkpoint(run, 7)
    out = tmp_path / "hf"
    assert main(["checkpoint", "consolidate", str(run), "--hf", str(out), "--max-shard-size", "40B"]) == 0
    line = capsys.readouterr().out
    assert line.startswith(f"wrote {out}: model-00001-of-00003.safetensors .. model-00003-of-00003.safetensors, "
                           f"{INDEX}, no config.json")
    assert f"4 tensors, 33 parameters (fp32, 140 B) from {ckpt} (step 7, saved at dp 2 × tp 2" in line
    (tmp_path / "c.json").write_text(json.dumps({"model_type": "llama", "tie_word_embeddings": True}))
    assert main(["checkpoint", "consolidate", str(ckpt), "--hf", str(tmp_path / "hf2"), "--config",
                 str(tmp_path / "c.json")]) == 0
    assert "model-00001-of-00001.safetensors, model.safetensors.index.json, config.json (from " in \
        capsys.readouterr().out
    assert (tmp_path / "hf2" / "config.json").is_file()

    for argv, said in [
        (["--hf", str(out)], f"cannot write the Hugging Face directory {out}: it is a directory with files in it"),
        (["--hf", str(ckpt / "x")], "lies inside the checkpoint directory"),
        (["--hf", "/proc/x"], "cannot write the Hugging Face directory /proc/x"),
        (["--hf", str(tmp_path / "n"), "--max-shard-size", "big"], "max_shard_size must be a size"),
        (["--hf", str(tmp_path / "n"), "--out", str(tmp_path / "m.pt")], "one of --out FILE"),
        ([], "needs one of --out FILE (a state dict) or --hf DIR"),
        (["--out", str(tmp_path / "m.pt"), "--config", "c.json"], "--config is an option of --hf DIR"),
        (["--hf", str(tmp_path / "n"), "--format", "pt"], "--hf always writes safetensors"),
    ]:
        err = _refused(["checkpoint", "consolidate", str(run), *argv], capsys)
        assert said in err, (argv, err)
    assert not (tmp_path / "n").exists() and not (tmp_path / "m.pt").exists()
    assert layout.latest(run) == ckpt
