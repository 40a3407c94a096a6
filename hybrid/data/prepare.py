"""Text → token file: what ``hybrid data prepare`` does, as a library function.

``prepare(sources, out, tokenizer=None)`` tokenises the text files ``sources`` in order, back to back,
and writes the token file ``out`` (``uint16`` when the vocabulary fits, else ``uint32``) and its metadata
``out.json`` (``hybrid.data.tokens``). The default tokenizer is byte-level: every byte is one token of a
256-token vocabulary, so any file, UTF-8 or not, tokenises and ``decode`` gives its bytes back. With a
``tokenizer.json`` (the Hugging Face ``tokenizers`` format; the package is the ``data`` extra) the text
must be UTF-8 and the vocabulary is the tokenizer's.

``--out`` is checked before any text is read: it (or its metadata path) must not be a directory or
another non-regular file, must not be one of the sources, and must lie in a directory that can be made and
written. Both files are written under temporary names and published when complete -- the metadata first,
then the token file -- so a failed or interrupted run never leaves a new token file without its metadata
(the reader, ``hybrid.data.tokens.TokenFile``, needs both): a new ``--out`` gets both files or neither; a
replaced one whose token file's rename fails keeps its old token file without metadata, which the reader
refuses with a sentence saying to prepare it again. A
missing or non-regular source, text without a single token, a tokenizer file that does not load, an
``--out`` that cannot be written (any ``OSError`` writing it): one ``DataError`` sentence each.
"""

from __future__ import annotations

import contextlib
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
        if path.exists() and not path.is_file():
            raise DataError(f"text file {path} is not a regular file (a device, FIFO or socket); pass regular "
                            "text files.")
        if not path.is_file():
            raise DataError(f"text file {path} does not exist; pass existing text files.")
    return paths


def temporary_paths(out: Path) -> tuple[Path, Path]:
    """The names the token file ``out`` and its metadata are written under before they are published."""
    tmp = out.with_name(f".{out.name}.tmp")
    return tmp, tmp.with_name(tmp.name + ".json")


def check_out(out: str | os.PathLike, sources: Sequence[Path]) -> Path:
    """``out`` as a path, checked before any work: neither it nor its metadata path is a directory or another
    non-regular file, none of the paths written (final or temporary) is a source, and its directory exists
    (it is made if missing). Raises ``DataError`` naming ``--out`` otherwise."""
    out = Path(out)
    if out.is_dir():
        raise DataError(f"--out {out} is a directory; give the path of the token file to write, e.g. {out}/train.bin.")
    meta = metadata_path(out)
    if meta.is_dir():
        raise DataError(f"--out {out} needs its metadata file {meta}, which is a directory; remove that directory "
                        "or choose another --out.")
    for target in (out, meta):
        if target.exists() and not target.is_file():
            raise DataError(f"--out {out} would replace {target}, which is not a regular file; give --out the path "
                            "of a token file to write.")
    tmp, meta_tmp = temporary_paths(out)
    _check_not_a_source(out, {out: "", meta: " with its metadata", tmp: " with a temporary file",
                              meta_tmp: " with a temporary file"}, sources)
    _make_parent(out)
    return out


def _check_not_a_source(out: Path, targets: dict[Path, str], sources: Sequence[Path]) -> None:
    """Raises ``DataError`` if writing any of ``targets`` (path -> what is written there, for the message)
    would overwrite one of ``sources``."""
    for target, what in targets.items():
        for source in sources:
            if _same_file(target, source):
                raise DataError(f"--out {out} would overwrite the text file {source}{what}; give --out a path "
                                "that is not one of the text files.")


def _same_file(a: Path, b: Path) -> bool:
    """Whether ``a`` and ``b`` name the same file: the same inode if both exist, else the same resolved path."""
    try:
        return os.path.samefile(a, b)
    except OSError:  # one of them does not exist (yet)
        return a.resolve() == b.resolve()


def _make_parent(out: Path) -> None:
    """Makes the directory ``out`` goes in; raises ``DataError`` if a file stands in the way or it cannot be made."""
    for ancestor in out.parents:
        if ancestor.exists():
            if not ancestor.is_dir():
                raise DataError(f"--out {out} is inside {ancestor}, which is a file, not a directory; give --out a "
                                "path in a directory.")
            break
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise _write_error(out, err) from None


def _write_error(out: Path, err: OSError) -> DataError:
    """The one-sentence ``DataError`` for an ``OSError`` raised while writing ``--out``."""
    where = f" ({err.filename})" if err.filename else ""
    return DataError(f"cannot write --out {out}: {err.strerror or err}{where}; give --out a path in a writable "
                     "directory with room for the tokens.")


def prepare(sources: Sequence[str | os.PathLike], out: str | os.PathLike, tokenizer: Optional[str | os.PathLike] = None,
            progress: Optional[Callable[[int], None]] = None) -> TokenFileMeta:
    """Tokenise ``sources`` into the token file ``out`` and its metadata; ``progress(n)`` is called with the
    number of source bytes consumed since its last call. Returns the metadata written. Both output files
    are opened before any text is read; on any failure neither temporary file is left behind."""
    paths = check_sources(sources)
    out = check_out(out, paths)
    tok = load_tokenizer(tokenizer)
    tmp, meta_tmp = temporary_paths(out)
    try:
        with open(tmp, "wb") as sink, open(meta_tmp, "w") as meta_sink:
            counts, total = _tokenise(paths, tok, sink, progress)
            meta = TokenFileMeta(dtype=dtype_for(tok.vocab_size), vocab_size=tok.vocab_size, tokens=total,
                                 tokenizer=tok.name, unigram_entropy_nats=unigram_entropy(counts),
                                 sources=tuple(p.name for p in paths))
            meta_sink.write(meta.to_json())
        _publish(tmp, meta_tmp, out)
        return meta
    except OSError as err:
        raise _write_error(out, err) from None
    finally:
        for leftover in (tmp, meta_tmp):
            with contextlib.suppress(OSError):
                leftover.unlink(missing_ok=True)


def _tokenise(paths: Sequence[Path], tok, sink, progress: Optional[Callable[[int], None]]) -> tuple[np.ndarray, int]:
    """Writes the tokens of ``paths`` to ``sink``; returns the count of each token id and the total. Raises
    ``DataError`` for an id outside the vocabulary or text without a single token."""
    dtype = DTYPES[dtype_for(tok.vocab_size)]
    counts = np.zeros(tok.vocab_size, dtype=np.int64)
    total = 0
    for path in paths:
        for chunk in _chunks(path, tok.streams):
            ids = tok.encode(chunk, path)
            if ids.size and int(ids.max()) >= tok.vocab_size:
                raise DataError(f"the tokenizer produced id {int(ids.max())} for {path}, not below its "
                                f"vocab_size {tok.vocab_size}; the tokenizer.json is inconsistent.")
            counts += np.bincount(ids, minlength=tok.vocab_size)
            total += int(ids.size)
            sink.write(ids.astype(dtype).tobytes())
            if progress is not None:
                progress(len(chunk))
    if total == 0:
        raise DataError(f"the text given ({', '.join(str(p) for p in paths)}) holds no tokens; pass "
                        "non-empty files.")
    return counts, total


def _publish(tmp: Path, meta_tmp: Path, out: Path) -> None:
    """Renames the complete temporaries into place, metadata first: a reader never finds the new token file
    without its metadata. If the token file's rename fails, the metadata just published is removed again
    (it describes tokens that are not there)."""
    meta = metadata_path(out)
    os.replace(meta_tmp, meta)
    try:
        os.replace(tmp, out)
    except OSError:
        with contextlib.suppress(OSError):
            meta.unlink(missing_ok=True)
        raise


def _chunks(path: Path, streams: bool):
    """The bytes of ``path``: in ``READ_CHUNK`` pieces if ``streams``, else whole. Raises ``DataError`` if the
    file cannot be read (so an ``OSError`` escaping ``prepare``'s loop is always one writing ``--out``)."""
    try:
        with open(path, "rb") as f:
            if not streams:
                yield f.read()
                return
            while chunk := f.read(READ_CHUNK):
                yield chunk
    except OSError as err:
        raise DataError(f"cannot read text file {path}: {err.strerror or err}; pass readable text files.") from None
