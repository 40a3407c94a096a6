"""``hybrid data prepare`` on plain text: text → token file round trip (bytes and tokenizer.json; text files alone
are written back to back, without separators, as before documents existed), one sentence per bad input, and the
built-in GPT's checks on the file its model config names. JSON Lines, Parquet and documents:
test_data_formats.py."""

import json
import math
import os

import numpy as np
import pytest

from hybrid.data import TokenFile, metadata_path
from hybrid.data.prepare import ByteTokenizer, JsonTokenizer, prepare
from hybrid.data.tokens import unigram_entropy
from hybrid.errors import ConfigError, DataError
from hybrid.models.gpt.config import GPTConfig
from hybrid.models.gpt.training import data_path, data_source
from hybrid.runtime.train import Context, JobSettings
from launch.cli import main

TEXT = "The quick brown fox jumps over the lazy dog.\n" * 20


def run_cli(args, capsys):
    code = main(["data", "prepare", *map(str, args)])
    out, err = capsys.readouterr()
    return code, out, err


def test_bytes_round_trip_through_the_command_including_non_utf8(tmp_path, capsys):
    a, b = tmp_path / "a.txt", tmp_path / "b.bin"
    a.write_text(TEXT)
    b.write_bytes(bytes(range(256)) * 3)  # not UTF-8: fine for the byte-level tokenizer
    code, out, err = run_cli([a, b, "--out", tmp_path / "out" / "corpus.bin"], capsys)
    assert code == 0, err
    path = tmp_path / "out" / "corpus.bin"
    raw = a.read_bytes() + b.read_bytes()
    assert f"{len(raw):,} tokens (uint16, vocabulary 256, tokenizer bytes)" in out
    meta = json.loads(metadata_path(path).read_text())
    assert meta["tokens"] == len(raw) and meta["dtype"] == "uint16" and meta["sources"] == ["a.txt", "b.bin"]
    expected_entropy = unigram_entropy(np.bincount(np.frombuffer(raw, np.uint8), minlength=256))
    assert meta["unigram_entropy_nats"] == pytest.approx(expected_entropy)
    assert f"unigram entropy {expected_entropy:.3f} nats" in out
    tf = TokenFile(path, seq_len=16)
    assert ByteTokenizer().decode(np.asarray(tf._data)) == raw
    assert np.array_equal(tf._data, np.frombuffer(raw, np.uint8)), "text files alone: back to back, no separator"
    assert meta["documents"] == 2 and meta["eot"] is None and "2 documents" in out
    assert not list(path.parent.glob(".*tmp*")), "temporary files left behind"


def _tokenizer_json(path):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator([TEXT], trainers.BpeTrainer(vocab_size=60, special_tokens=["[UNK]"]))
    tok.save(str(path))
    return path


def test_a_tokenizer_json_round_trips_and_sets_the_vocabulary(tmp_path, capsys):
    pytest.importorskip("tokenizers")
    tok = _tokenizer_json(tmp_path / "tokenizer.json")
    text = tmp_path / "t.txt"
    text.write_text(TEXT)
    code, out, err = run_cli([text, "--out", tmp_path / "t.bin", "--tokenizer", tok], capsys)
    assert code == 0, err
    loaded = JsonTokenizer(tok)
    tf = TokenFile(tmp_path / "t.bin", seq_len=8)
    assert tf.vocab_size == loaded.vocab_size and tf.meta.tokenizer == "tokenizer.json"
    assert loaded.decode(np.asarray(tf._data)).split() == loaded.decode(loaded.encode(TEXT.encode(), text)).split()
    assert "".join(loaded.decode(np.asarray(tf._data)).split()) == "".join(TEXT.split())
    bad = tmp_path / "latin1.txt"
    bad.write_bytes("caf\xe9".encode("latin-1"))
    code, _, err = run_cli([bad, "--out", tmp_path / "x.bin", "--tokenizer", tok], capsys)
    assert code == 2 and err.count("\n") == 1 and "is not UTF-8 text (byte 3)" in err


def test_bad_input_is_one_sentence_each(tmp_path, capsys):
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    junk = tmp_path / "junk.json"
    junk.write_text("{not a tokenizer")
    good = tmp_path / "good.txt"
    good.write_text(TEXT)
    (tmp_path / "nothing").mkdir()
    (tmp_path / "nothing" / "notes.md").write_text(TEXT)
    cases = [([tmp_path / "missing.txt"], "does not exist; pass existing files, directories or globs."),
             ([empty], "hold no tokens; pass non-empty files."),
             ([tmp_path / "nothing"], "holds no .jsonl, .jsonl.gz, .parquet, .txt file; pass the files in it"),
             ([good, "--tokenizer", junk], "does not load as a tokenizer.json"),
             ([good, "--tokenizer", tmp_path / "none.json"], "tokenizer file"),
             ]
    for args, expected in cases:
        code, out, err = run_cli([*args, "--out", tmp_path / "o.bin"], capsys)
        assert code == 2 and err.startswith("error: ") and err.count("\n") == 1 and expected in err, err
        assert "Traceback" not in err
    code, _, err = run_cli([good, "--out", tmp_path], capsys)
    assert code == 2 and "is a directory; give the path of the token file to write" in err
    assert not (tmp_path / "o.bin").exists()


def _ctx(tmp_path, data, vocab_size=256):
    config_path = tmp_path / "model.yaml"
    model = {"vocab_size": vocab_size, "seq_len": 8, "n_layers": 1, "hidden": 16, "n_heads": 2}
    ctx = Context(None, {"model": model, "data": data}, JobSettings(steps=1, micro_batch=2, stage=0),
                  model_config_path=str(config_path))
    return ctx, GPTConfig.from_dict(model)


def test_the_built_in_gpt_reads_data_relative_to_its_model_config_and_checks_the_vocabulary(tmp_path):
    text = tmp_path / "t.txt"
    text.write_text(TEXT)
    prepare([text], tmp_path / "data" / "c.bin")
    ctx, config = _ctx(tmp_path, "data/c.bin")
    assert data_path("data/c.bin", ctx.model_config_path) == tmp_path / "data" / "c.bin"
    source, reference = data_source(ctx, config, {"branching": 4})
    assert isinstance(source, TokenFile) and reference["nats"] == pytest.approx(source.unigram_entropy)
    ctx, config = _ctx(tmp_path, "data/c.bin", vocab_size=128)
    with pytest.raises(ConfigError) as info:
        data_source(ctx, config, {"branching": 4})
    assert str(info.value) == (f"model.vocab_size is 128, below the vocabulary of the data file "
                               f"{tmp_path / 'data' / 'c.bin'} (256); set model.vocab_size to at least 256.")
    ctx, config = _ctx(tmp_path, "nowhere.bin")
    with pytest.raises(DataError, match="does not exist"):
        data_source(ctx, config, {"branching": 4})


def _one_error_line(code, err, expected):
    assert code == 2 and err.startswith("error: ") and err.count("\n") == 1 and expected in err, err
    assert "Traceback" not in err


def test_an_out_that_cannot_be_written_is_one_sentence_and_leaves_nothing(tmp_path, capsys):
    good = tmp_path / "good.txt"
    good.write_text(TEXT)
    (tmp_path / "ro" / "x.bin.json").mkdir(parents=True)  # the metadata path is taken by a directory
    cases = [(good / "x.bin", "is inside"),                       # a file where --out's directory should be
             (tmp_path / "ro" / "x.bin", "needs its metadata file"),
             ("/dev/null", "which is not a regular file")]
    for out, expected in cases:
        code, _, err = run_cli([good, "--out", out], capsys)
        _one_error_line(code, err, expected)
    assert sorted(p.name for p in (tmp_path / "ro").iterdir()) == ["x.bin.json"], "a token file without metadata"
    assert good.read_text() == TEXT


def test_an_os_error_writing_out_is_one_sentence_naming_out(tmp_path, capsys, monkeypatch):
    good = tmp_path / "good.txt"
    good.write_text(TEXT)
    real_open = open

    def refuse_temporaries(path, *args, **kwargs):
        if str(path).endswith(".tmp"):
            raise FileNotFoundError(2, "No such file or directory", str(path))
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr("builtins.open", refuse_temporaries)  # what /proc does to a new file
    code, _, err = run_cli([good, "--out", tmp_path / "o.bin"], capsys)
    _one_error_line(code, err, f"cannot write --out {tmp_path / 'o.bin'}: No such file or directory")
    assert not list(tmp_path.glob("*o.bin*"))


@pytest.mark.parametrize("failing", ["metadata", "tokens"])
def test_a_failed_publish_leaves_neither_file(tmp_path, capsys, monkeypatch, failing):
    good = tmp_path / "good.txt"
    good.write_text(TEXT)
    out = tmp_path / "o.bin"
    real_replace = os.replace

    def replace(src, dst):
        if str(dst).endswith(".json") == (failing == "metadata"):
            raise PermissionError(13, "Permission denied", str(dst))
        return real_replace(src, dst)

    monkeypatch.setattr("hybrid.data.prepare.os.replace", replace)
    code, _, err = run_cli([good, "--out", out], capsys)
    _one_error_line(code, err, "Permission denied")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["good.txt"]


def test_out_never_overwrites_a_source(tmp_path, capsys, monkeypatch):
    text, other = tmp_path / "same.txt", tmp_path / "x.bin.json"
    text.write_text(TEXT)
    other.write_text(TEXT)
    (tmp_path / "link.bin").symlink_to(text)
    monkeypatch.chdir(tmp_path)
    cases = [([text, "--out", text], ""),
             (["same.txt", "--out", tmp_path / "same.txt"], ""),           # relative and absolute spellings
             ([text, "--out", "link.bin"], ""),                            # a link to the source
             ([text, other, "--out", tmp_path / "x.bin"], " with its metadata")]
    for args, what in cases:
        code, _, err = run_cli(args, capsys)
        _one_error_line(code, err, f"would overwrite the source {args[-3]}{what}; give --out a path that is "
                                   "not one of the sources.")
    assert text.read_text() == TEXT and other.read_text() == TEXT
    assert not (tmp_path / "x.bin").exists()


def test_a_source_that_is_not_a_regular_file_says_so(tmp_path, capsys):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    for source in ("/dev/null", fifo):
        code, _, err = run_cli([source, "--out", tmp_path / "n.bin"], capsys)
        _one_error_line(code, err, f"source {source} is not a regular file")
        assert "does not exist" not in err


def test_a_single_repeated_token_has_entropy_plus_zero(tmp_path, capsys):
    text = tmp_path / "a.txt"
    text.write_bytes(b"a" * 1000)
    code, out, err = run_cli([text, "--out", tmp_path / "a.bin"], capsys)
    assert code == 0, err
    assert "unigram entropy 0.000 nats (0.000 bits)" in out
    stored = json.loads(metadata_path(tmp_path / "a.bin").read_text())["unigram_entropy_nats"]
    assert stored == 0.0 and math.copysign(1.0, stored) == 1.0
    assert math.copysign(1.0, unigram_entropy(np.array([0, 7, 0]))) == 1.0


def test_data_outside_the_shipped_working_dir_is_read_where_the_driver_sees_it(tmp_path):
    """Under Ray a rank reads a copy of job.working_dir; data: resolves against the user's model config, maps
    into the copy when it lies inside the working dir, and is read at the driver's path otherwise (or when a
    .gitignore left it out of the copy); every error names the user's path."""
    from launch.ray.runtime_env import localize_shipped

    work, copy, text = tmp_path / "work", tmp_path / "copy", tmp_path / "t.txt"
    text.write_text(TEXT)
    for where in (tmp_path / "data" / "c.bin", work / "in.bin", work / "ignored.bin"):
        prepare([text], where)
    copy.mkdir()
    (copy / "in.bin").write_bytes((work / "in.bin").read_bytes())
    (copy / "in.bin.json").write_bytes((work / "in.bin.json").read_bytes())
    (copy / "model.yaml").write_text("")
    local = lambda path: localize_shipped(path, str(work), str(copy))  # noqa: E731
    model = {"vocab_size": 256, "seq_len": 8, "n_layers": 1, "hidden": 16, "n_heads": 2}
    for data, read in (("../data/c.bin", tmp_path / "data" / "c.bin"), ("in.bin", copy / "in.bin"),
                       ("ignored.bin", work / "ignored.bin")):
        ctx = Context(None, {"model": model, "data": data}, JobSettings(steps=1, micro_batch=2, stage=0),
                      model_config_path=str(copy / "model.yaml"), model_config_origin=str(work / "model.yaml"),
                      local_path=local)
        source, _ = data_source(ctx, GPTConfig.from_dict(model), {"branching": 4})
        assert source.path == read, data
        with pytest.raises(DataError) as info:  # raised while training, not while opening
            source.starts(0, 10**6)
        assert f"data file {(work / data).resolve()} holds" in str(info.value), info.value

    (copy / "in.bin").write_bytes((copy / "in.bin").read_bytes()[:-1])  # the copy is damaged
    ctx = Context(None, {"model": model, "data": "in.bin"}, JobSettings(steps=1, micro_batch=2, stage=0),
                  model_config_path=str(copy / "model.yaml"), model_config_origin=str(work / "model.yaml"),
                  local_path=local)
    with pytest.raises(DataError) as info:
        data_source(ctx, GPTConfig.from_dict(model), {"branching": 4})
    assert str(work / "in.bin") in str(info.value) and str(copy) not in str(info.value)
