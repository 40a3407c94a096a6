"""Text → token file: what ``hybrid data prepare`` does, as a library function.

``prepare(sources, out, tokenizer=None)`` tokenises the text files ``sources`` in order, back to back,
and writes the token file ``out`` (``uint16`` when the vocabulary fits, else ``uint32``) and its metadata
``out.json`` (``hybrid.data.tokens``). The default tokenizer is byte-level: every byte is one token of a
256-token vocabulary, so any file, UTF-8 or not, tokenises and ``decode`` gives its bytes back. With a
``tokenizer.json`` (the Hugging Face ``tokenizers`` format; the package is the ``data`` extra) the text
must be UTF-8 and the vocabulary is the tokenizer's. Both files are written under temporary names and
renamed when complete, so an interrupted run never leaves a token file that looks whole. A missing
source, a directory, text without a single token, a tokenizer file that does not load: one ``DataError``
sentence each.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable, Optional, Sequence

import numpy as np

from hybrid.data.tokens import DTYPES, TokenFileMeta, dtype_for, metadata_path, unigram_entropy
from hybrid.errors import DataError

READ_CHUNK = 1 << 22  # bytes read at a time by the byte-level tokenizer


class ByteTokenizer:
    """Every byte is a token: vocabulary 256, any input."""

    name = "bytes"
    vocab_size = 256
    streams = True  # can encode a file chunk by chunk

    def encode(self, data: bytes, source: Path) -> np.ndarray:
        return np.frombuffer(data, dtype=np.uint8)

    def decode(self, ids) -> bytes:
        return bytes(int(i) for i in ids)


class JsonTokenizer:
    """A ``tokenizer.json`` loaded with the ``tokenizers`` package; encodes whole UTF-8 files."""

    streams = False

    def __init__(self, path: Path):
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise DataError("--tokenizer needs the tokenizers package; install it with "
                            "`pip install 'hybrid-parallel[data]'` or leave --tokenizer out for bytes.") from None
        if not path.is_file():
            raise DataError(f"tokenizer file {path} does not exist; give the path of a tokenizer.json.")
        try:
            self._tok = Tokenizer.from_file(str(path))
        except Exception as err:  # tokenizers raises its own Exception type for a malformed file
            raise DataError(f"tokenizer file {path} does not load as a tokenizer.json ({err}); give a file "
                            "saved by the tokenizers package.") from None
        self.name = path.name
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, data: bytes, source: Path) -> np.ndarray:
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as err:
            raise DataError(f"{source} is not UTF-8 text (byte {err.start}); the tokenizer.json needs UTF-8, so "
                            "re-encode the file or leave --tokenizer out to tokenise bytes.") from None
        return np.asarray(self._tok.encode(text, add_special_tokens=False).ids, dtype=np.int64)

    def decode(self, ids) -> str:
        return self._tok.decode([int(i) for i in ids])


def load_tokenizer(path: Optional[str | os.PathLike]):
    return ByteTokenizer() if path is None else JsonTokenizer(Path(path))


def check_sources(sources: Sequence[str | os.PathLike]) -> list[Path]:
    """The sources as paths, each an existing regular file; raises ``DataError`` for the first that is not."""
    if not sources:
        raise DataError("no text given; pass one or more text files to tokenise.")
    paths = [Path(s) for s in sources]
    for path in paths:
        if path.is_dir():
            raise DataError(f"{path} is a directory; pass the text files in it (e.g. {path}/*.txt).")
        if not path.is_file():
            raise DataError(f"text file {path} does not exist; pass existing text files.")
    return paths


def prepare(sources: Sequence[str | os.PathLike], out: str | os.PathLike, tokenizer: Optional[str | os.PathLike] = None,
            progress: Optional[Callable[[int], None]] = None) -> TokenFileMeta:
    """Tokenise ``sources`` into the token file ``out`` and its metadata; ``progress(n)`` is called with the
    number of source bytes consumed since its last call. Returns the metadata written."""
    paths = check_sources(sources)
    tok = load_tokenizer(tokenizer)
    out = Path(out)
    if out.is_dir():
        raise DataError(f"--out {out} is a directory; give the path of the token file to write, e.g. {out}/train.bin.")
    out.parent.mkdir(parents=True, exist_ok=True)
    dtype = dtype_for(tok.vocab_size)
    counts = np.zeros(tok.vocab_size, dtype=np.int64)
    total = 0
    tmp = out.with_name(f".{out.name}.tmp")
    try:
        with open(tmp, "wb") as sink:
            for path in paths:
                for chunk in _chunks(path, tok.streams):
                    ids = tok.encode(chunk, path)
                    if ids.size and int(ids.max()) >= tok.vocab_size:
                        raise DataError(f"the tokenizer produced id {int(ids.max())} for {path}, not below its "
                                        f"vocab_size {tok.vocab_size}; the tokenizer.json is inconsistent.")
                    counts += np.bincount(ids, minlength=tok.vocab_size)
                    total += int(ids.size)
                    sink.write(ids.astype(DTYPES[dtype]).tobytes())
                    if progress is not None:
                        progress(len(chunk))
        if total == 0:
            raise DataError(f"the text given ({', '.join(str(p) for p in paths)}) holds no tokens; pass "
                            "non-empty files.")
        meta = TokenFileMeta(dtype=dtype, vocab_size=tok.vocab_size, tokens=total, tokenizer=tok.name,
                             unigram_entropy_nats=unigram_entropy(counts), sources=tuple(p.name for p in paths))
        meta_tmp = tmp.with_name(tmp.name + ".json")
        meta_tmp.write_text(meta.to_json())
        os.replace(tmp, out)
        os.replace(meta_tmp, metadata_path(out))
        return meta
    finally:
        for leftover in (tmp, tmp.with_name(tmp.name + ".json")):
            leftover.unlink(missing_ok=True)


def _chunks(path: Path, streams: bool):
    with open(path, "rb") as f:
        if not streams:
            yield f.read()
            return
        while chunk := f.read(READ_CHUNK):
            yield chunk
