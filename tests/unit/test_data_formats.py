"""``hybrid data prepare`` on data as people have it: directories of JSON Lines and Parquet shards, globs, a
tokenizer.json's own end-of-text token, byte-level documents ended by id 256, the held-out split, one sentence
per bad record, the progress line, and a corpus far larger than the memory the run uses."""

import gzip
import io
import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from hybrid.data import TokenFile, metadata_path
from hybrid.data.documents import expand_sources
from hybrid.data.prepare import Progress, eval_path, held_out, prepare
from hybrid.data.tokens import read_metadata
from hybrid.errors import DataError
from launch.cli import main
from launch.commands.data import ProgressLine, describe

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")
tokenizers = pytest.importorskip("tokenizers")

ROOT = Path(__file__).resolve().parents[2]
SENTENCES = ["the cat sat on the mat", "a dog ran in the park", "birds sing at dawn", "the sun is warm today",
             "rain falls on the roof", "fish swim in the deep sea", "the moon rose over hills", "snow covers the town"]


def _tokenizer(path, special=("[UNK]", "<|endoftext|>")):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(SENTENCES, trainers.BpeTrainer(vocab_size=80, special_tokens=list(special)))
    tok.save(str(path))
    return Tokenizer.from_file(str(path))


def _jsonl(path, texts, field="text", gz=False):
    lines = "".join(json.dumps({"id": i, field: t}) + "\n" for i, t in enumerate(texts))
    if gz:
        path.write_bytes(gzip.compress(lines.encode()))
    else:
        path.write_text(lines)


def _parquet(path, texts, field="text", row_group_size=None):
    pq.write_table(pa.table({field: texts, "n": list(range(len(texts)))}), path, row_group_size=row_group_size)


def _shards(root):
    """A directory of shards in an order its names sort into; returns the documents in that order."""
    (root / "b").mkdir(parents=True)
    docs = {"a-00.jsonl": SENTENCES[:3], "a-01.parquet": SENTENCES[3:5], "b/c.jsonl.gz": SENTENCES[5:6],
            "b/d.txt": ["the cat ran over the roof"]}
    _parquet(root / "a-01.parquet", docs["a-01.parquet"], row_group_size=1)
    _jsonl(root / "a-00.jsonl", docs["a-00.jsonl"])
    _jsonl(root / "b" / "c.jsonl.gz", docs["b/c.jsonl.gz"], gz=True)
    (root / "b" / "d.txt").write_text(docs["b/d.txt"][0])
    (root / "notes.md").write_text("not a source")          # other names are left out of a directory
    (root / ".hidden.jsonl").write_text("{broken\n")         # and so are hidden files
    return [t for name in sorted(docs) for t in docs[name]]


def run_cli(args, capsys):
    code = main(["data", "prepare", *map(str, args)])
    out, err = capsys.readouterr()
    return code, out, err


def _ids(path):
    return np.asarray(TokenFile(path, seq_len=1)._data).astype(np.int64)


def test_a_directory_of_shards_is_each_document_in_the_tokenizers_encoding_then_its_end_of_text(tmp_path, capsys):
    docs = _shards(tmp_path / "data")
    tok = _tokenizer(tmp_path / "tokenizer.json")
    eot = tok.token_to_id("<|endoftext|>")
    code, out, err = run_cli([tmp_path / "data", "--out", tmp_path / "c.bin", "--tokenizer",
                              tmp_path / "tokenizer.json"], capsys)
    assert code == 0, err
    expected = [i for d in docs for i in (*tok.encode(d, add_special_tokens=False).ids, eot)]
    assert _ids(tmp_path / "c.bin").tolist() == expected
    meta = read_metadata(tmp_path / "c.bin")
    assert (meta.documents, meta.eot, meta.tokens, meta.vocab_size) == (len(docs), eot, len(expected),
                                                                        tok.get_vocab_size())
    assert meta.sources == ("a-00.jsonl", "a-01.parquet", "c.jsonl.gz", "d.txt")
    assert f"from {len(docs)} documents, each ended by end of text {eot}" in out
    # --eot names another token; a glob and a file given twice (read once) give the same documents
    _tokenizer(tmp_path / "plain.json", special=("[UNK]", "[SEP]"))
    code, _, err = run_cli([str(tmp_path / "data" / "a-0*"), tmp_path / "data" / "a-00.jsonl", "--out",
                            tmp_path / "g.bin", "--tokenizer", tmp_path / "plain.json", "--eot", "[SEP]"], capsys)
    assert code == 0, err
    assert read_metadata(tmp_path / "g.bin").documents == 5 and read_metadata(tmp_path / "g.bin").eot == 1


def test_plain_text_files_alone_are_separated_only_with_eot(tmp_path):
    tok = _tokenizer(tmp_path / "tokenizer.json")
    texts = [tmp_path / "a.txt", tmp_path / "b.txt"]
    for path, sentence in zip(texts, SENTENCES):
        path.write_text(sentence)
    encoded = [tok.encode(s, add_special_tokens=False).ids for s in SENTENCES[:2]]
    eot = tok.token_to_id("<|endoftext|>")
    separated = encoded[0] + [eot] + encoded[1] + [eot]
    for option, expected in ((None, encoded[0] + encoded[1]), ("<|endoftext|>", separated)):
        meta = prepare(texts, tmp_path / "t.bin", tmp_path / "tokenizer.json", eot=option)
        assert _ids(tmp_path / "t.bin").tolist() == expected and meta.documents == 2
        assert meta.eot == (None if option is None else eot)


def test_byte_level_documents_end_with_id_256_and_text_files_alone_are_as_before(tmp_path):
    texts = ["héllo wörld", "", "second\nline", "{\"not\": \"parsed\"}"]  # the empty document is left out
    _jsonl(tmp_path / "d.jsonl", texts, field="body")
    (tmp_path / "d.txt").write_bytes(b"\xff raw")
    meta = prepare([tmp_path / "d.jsonl", tmp_path / "d.txt"], tmp_path / "b.bin", text_field="body")
    expected = [i for t in (*[t.encode() for t in texts if t], b"\xff raw") for i in (*t, 256)]
    assert _ids(tmp_path / "b.bin").tolist() == expected
    assert (meta.vocab_size, meta.eot, meta.documents, meta.dtype) == (257, 256, 4, "uint16")
    on_disk = json.loads(metadata_path(tmp_path / "b.bin").read_text())
    assert on_disk["eot"] == 256 and on_disk["documents"] == 4 and on_disk["vocab_size"] == 257
    meta = prepare([tmp_path / "d.txt"], tmp_path / "t.bin")
    assert (_ids(tmp_path / "t.bin").tolist(), meta.vocab_size, meta.eot) == (list(b"\xff raw"), 256, None)


def test_old_metadata_without_documents_reads_as_before(tmp_path):
    (tmp_path / "o.bin").write_bytes(np.arange(64, dtype="<u2").tobytes())
    metadata_path(tmp_path / "o.bin").write_text(json.dumps({"dtype": "uint16", "vocab_size": 256, "tokens": 64}))
    meta = read_metadata(tmp_path / "o.bin")
    assert meta.documents is None and meta.eot is None and TokenFile(tmp_path / "o.bin", seq_len=4).tokens == 64
    metadata_path(tmp_path / "o.bin").write_text(json.dumps({"dtype": "uint16", "vocab_size": 256, "tokens": 64,
                                                             "eot": 256}))
    with pytest.raises(DataError, match="says eot 256; it must be a whole number >= 0 below vocab_size 256"):
        read_metadata(tmp_path / "o.bin")


def test_the_eval_fraction_holds_out_whole_documents_deterministically(tmp_path, capsys):
    texts = [f"document {i} " + "x" * (i % 7) for i in range(103)]
    _jsonl(tmp_path / "d.jsonl", texts)
    prepare([tmp_path / "d.jsonl"], tmp_path / "all.bin")
    code, out, err = run_cli([tmp_path / "d.jsonl", "--out", tmp_path / "tr.bin", "--eval-fraction", 0.1], capsys)
    assert code == 0, err
    assert eval_path(tmp_path / "tr.bin") == tmp_path / "tr.eval.bin"
    train, held = (_ids(tmp_path / n) for n in ("tr.bin", "tr.eval.bin"))

    def documents(ids):
        return [bytes(d[:-1].tolist()).decode() for d in np.split(ids, np.flatnonzero(ids == 256) + 1)[:-1]]

    in_train, in_eval = documents(train), documents(held)
    assert in_eval == [t for i, t in enumerate(texts) if held_out(i, 0.1)]
    assert len(in_eval) == 10 and not set(in_train) & set(in_eval)
    assert sorted(in_train + in_eval) == sorted(texts) == sorted(documents(_ids(tmp_path / "all.bin")))
    assert train.size + held.size == _ids(tmp_path / "all.bin").size
    assert read_metadata(tmp_path / "tr.eval.bin").documents == 10 and "from 10 held-out documents" in out
    run_cli([tmp_path / "d.jsonl", "--out", tmp_path / "again.bin", "--eval-fraction", 0.1], capsys)
    assert (tmp_path / "again.eval.bin").read_bytes() == (tmp_path / "tr.eval.bin").read_bytes()
    assert [sum(held_out(i, f) for i in range(n)) for f, n in ((0.1, 103), (0.5, 7), (0.013, 1000))] == [10, 3, 13]


def _bad_inputs(tmp_path):
    """(sources, options, expected part of the one sentence)."""
    d = tmp_path
    (d / "nofield.jsonl").write_text('{"text": "ok"}\n\n{"body": "no text"}\n')
    (d / "notstr.jsonl").write_text('{"text": "ok"}\n{"text": 7}\n')
    (d / "null.jsonl").write_text('{"text": null}\n')
    (d / "bad.jsonl").write_text('{"text": "ok"}\n{"text": "ok",}\n')
    (d / "array.jsonl").write_text('["text"]\n')
    (d / "latin.jsonl").write_bytes('{"text": "caf\xe9"}\n'.encode("latin-1"))
    (d / "cut.jsonl.gz").write_bytes(gzip.compress(b'{"text": "a"}\n' * 100)[:30])
    (d / "junk.parquet").write_bytes(b"PAR1 this is not parquet")
    _parquet(d / "ints.parquet", [1, 2])
    _parquet(d / "other.parquet", ["a", "b"], field="content")
    _parquet(d / "nulls.parquet", ["a", None, "b"])
    (d / "empty").mkdir()
    tok = d / "tokenizer.json"
    _tokenizer(tok, special=("[UNK]",))
    return [
        ([d / "nofield.jsonl"], [], f"line 3 of {d / 'nofield.jsonl'} has no field 'text' (its fields: 'body'); "
                                    "pass --text-field naming the field that holds the text."),
        ([d / "notstr.jsonl"], [], f"field 'text' on line 2 of {d / 'notstr.jsonl'} is a number, not a string"),
        ([d / "null.jsonl"], [], "field 'text' on line 1 of"),
        ([d / "bad.jsonl"], [], f"line 2 of {d / 'bad.jsonl'} is not JSON (Expecting property name enclosed in "
                                "double quotes at column 15); fix the line or leave the file out."),
        ([d / "array.jsonl"], [], "line 1 of"),
        ([d / "latin.jsonl"], [], "is not UTF-8"),
        ([d / "cut.jsonl.gz"], [], f"cannot read {d / 'cut.jsonl.gz'}"),
        ([d / "junk.parquet"], [], f"{d / 'junk.parquet'} is not a readable Parquet file"),
        ([d / "ints.parquet"], [], "column 'text' of Parquet file"),
        ([d / "other.parquet"], [], "has no column 'text' (its columns: 'content', 'n'); pass --text-field"),
        ([d / "nulls.parquet"], [], "field 'text' on row 2 of Parquet file"),
        ([str(d / "*.nothing")], [], "matches no file"),
        ([d / "empty"], [], "holds no .jsonl"),
        ([d / "nofield.jsonl"], ["--text-field", "body"], "line 1 of"),
        ([d / "other.parquet"], ["--tokenizer", tok], "has no end-of-text token among its added tokens ('[UNK]';"),
        ([d / "other.parquet"], ["--tokenizer", tok, "--eot", "<eos>"], "--eot '<eos>' is not a token of"),
        ([d / "other.parquet"], ["--eot", "<eos>"], "byte-level runs end documents with their own id 256"),
        ([d / "other.parquet"], ["--text-field", "content", "--eval-fraction", 1.5], "is not between 0 and 1"),
        ([d / "other.parquet"], ["--text-field", "content", "--eval-fraction", 0.2], "holds out none of the 2"),
    ]


def test_bad_records_and_sources_are_one_sentence_each_and_leave_nothing(tmp_path, capsys):
    data = tmp_path / "in"
    data.mkdir()
    for sources, options, expected in _bad_inputs(data):
        code, out, err = run_cli([*sources, *options, "--out", tmp_path / "o.bin"], capsys)
        assert code == 2 and err.startswith("error: ") and err.count("\n") == 1 and expected in err, (expected, err)
        assert "Traceback" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in"], "an output or a temporary was left behind"


def test_parquet_without_pyarrow_is_one_sentence(tmp_path, monkeypatch):
    _parquet(tmp_path / "d.parquet", ["a"])
    _jsonl(tmp_path / "d.jsonl", ["a"])
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # import pyarrow raises ImportError
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    prepare([tmp_path / "d.jsonl"], tmp_path / "ok.bin")  # JSON Lines never needs it
    with pytest.raises(DataError) as info:
        prepare([tmp_path / "d.parquet"], tmp_path / "o.bin")
    assert str(info.value) == (f"{tmp_path / 'd.parquet'} is a Parquet file, which needs the pyarrow package; "
                               "install it with `pip install 'hybrid-parallel[data]'` or convert the file to "
                               "JSON Lines.")


def test_sources_expand_in_a_sorted_deterministic_order(tmp_path):
    docs = _shards(tmp_path / "data")
    assert docs[0] == SENTENCES[0]
    names = [s.path.relative_to(tmp_path / "data").as_posix() for s in expand_sources([tmp_path / "data"])]
    assert names == ["a-00.jsonl", "a-01.parquet", "b/c.jsonl.gz", "b/d.txt"]
    kinds = [s.kind for s in expand_sources([tmp_path / "data"])]
    assert kinds == ["jsonl", "parquet", "jsonl", "text"]
    globbed = expand_sources([str(tmp_path / "data" / "**" / "*.jsonl*"), tmp_path / "data" / "b"])
    assert [s.path.name for s in globbed] == ["a-00.jsonl", "c.jsonl.gz", "d.txt"]


def test_the_progress_line_counts_documents_tokens_and_bytes(tmp_path, capsys, monkeypatch):
    _jsonl(tmp_path / "d.jsonl", SENTENCES)
    seen = []
    prepare([tmp_path / "d.jsonl"], tmp_path / "p.bin", progress=seen.append)
    size = (tmp_path / "d.jsonl").stat().st_size
    assert seen[-1] == Progress(files=1, files_total=1, documents=8, tokens=sum(len(s) + 1 for s in SENTENCES),
                                bytes_read=size, bytes_total=size)
    terminal = io.StringIO()
    line = ProgressLine(terminal, tty=True, every=0.0)
    line(seen[0])
    line(seen[-1])
    line.close()
    assert terminal.getvalue() == f"\r{describe(seen[0])}\r{describe(seen[-1])}\n"
    monkeypatch.setattr("launch.commands.data.LOG_SECONDS", 0.0)
    code, out, err = run_cli([tmp_path / "d.jsonl", "--out", tmp_path / "q.bin"], capsys)
    assert code == 0 and f"tokenising: 100% of {size} B read (1/1 files), 8 documents, {seen[-1].tokens} tokens\n" \
        in err


def _corpus(root, shards):
    """``shards`` JSON Lines and Parquet shards, alternating, of 1,000 documents of 20,000 characters of
    varied text each; returns the characters (bytes) of text in all."""
    rng = np.random.default_rng(0)
    words = np.array(["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "theta", "kappa", "lambda", "omega"])
    pool = " ".join(rng.choice(words, 500_000))
    root.mkdir()
    for shard in range(shards):
        texts = [pool[a:a + 20_000] for a in rng.integers(0, len(pool) - 20_000, 1000)]
        if shard % 2:
            _parquet(root / f"s{shard:03d}.parquet", texts, row_group_size=100)
        else:
            _jsonl(root / f"s{shard:03d}.jsonl", texts)
    return shards * 1000 * 20_000


PEAK = """import re, sys
from launch.cli import main
code = main(["data", "prepare", *sys.argv[1:]])
status = open("/proc/self/status").read()
print("VmHWM", int(re.search(r"VmHWM:\\s+(\\d+) kB", status).group(1)) * 1024, file=sys.stderr)
sys.exit(code)
"""


def _peak_rss(args, cwd):
    """Exit status, peak resident memory (bytes) and output of ``hybrid data prepare args`` in a fresh process.
    The process reads its own high-water mark (a parent's ``ru_maxrss`` of a child counts the parent's memory
    at the fork)."""
    proc = subprocess.run([sys.executable, "-c", PEAK, *map(str, args)], cwd=cwd, capture_output=True, text=True,
                          timeout=120)
    peak = re.search(r"VmHWM (\d+)", proc.stderr)
    return proc.returncode, int(peak.group(1)) if peak else 0, proc.stdout + proc.stderr


@pytest.mark.slow
def test_a_corpus_far_larger_than_the_memory_it_uses_streams_through(tmp_path):
    """200 MB of text (JSON Lines and Parquet) through a process whose peak memory exceeds that of a run on a
    tiny corpus by under a quarter of it: the corpus is never held whole (a run that held it would need its
    size again, and its tokens)."""
    size = _corpus(tmp_path / "big", 10)
    (tmp_path / "small").mkdir()
    _jsonl(tmp_path / "small" / "a.jsonl", SENTENCES)
    _parquet(tmp_path / "small" / "b.parquet", SENTENCES)
    code, base, out = _peak_rss([tmp_path / "small", "--out", tmp_path / "s.bin"], ROOT)
    assert code == 0, out
    code, peak, out = _peak_rss([tmp_path / "big", "--out", tmp_path / "b.bin", "--eval-fraction", 0.01], ROOT)
    assert code == 0, out
    metas = [read_metadata(tmp_path / name) for name in ("b.bin", "b.eval.bin")]
    assert sum(m.tokens for m in metas) == size + 10_000 and sum(m.documents for m in metas) == 10_000
    figures = f"peak {peak / 1e6:.0f} MB, {base / 1e6:.0f} MB on a tiny corpus, {size / 1e6:.0f} MB of text"
    print(figures)
    assert peak - base < size / 4, figures
