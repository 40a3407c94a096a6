"""Sources → token file: what ``hybrid data prepare`` does, as a library function.

``prepare(sources, out, tokenizer=None, *, text_field="text", eot=None, eval_fraction=None, progress=None)``
reads the documents of ``sources`` (files, directories, globs: plain text, JSON Lines, Parquet;
``hybrid.data.documents``) in order, streaming -- one batch of documents (about ``BATCH_BYTES`` of text) in
memory at a time, encoded together and appended to the output -- and writes the token file ``out``
(``uint16`` when the vocabulary fits, else ``uint32``) and its metadata ``out.json`` (``hybrid.data.tokens``:
tokens, documents, end-of-text id, unigram entropy, source names). The tokenizer (``hybrid.data.encoders``)
is byte-level by default (vocabulary 256) or a ``tokenizer.json``.

Documents: each JSON Lines line and each Parquet row is one document, and so is each plain text file. A run
with any JSON Lines or Parquet source, or with ``eot`` (``--eot``), ends every document with the end-of-text
token: byte-level, the reserved id 256 (the vocabulary becomes 257); a ``tokenizer.json``'s own (``--eot``, or
found among its added tokens). A run of plain text files alone, without ``--eot``, writes them back to back
with no separator, exactly as before documents existed. An empty document is left out.

``eval_fraction`` F (0 < F < 1) holds out whole documents into ``eval_path(out)`` (``corpus.bin`` →
``corpus.eval.bin``, with its own metadata): document ``i`` (counted from 0 over all sources in order) is held
out when ``floor((i + 1) F) > floor(i F)`` -- every ``1/F``-th document, spread evenly, ``floor(N F)`` of
``N`` -- so the two files share no document and together hold every token a run without F writes.

Every output is checked before any text is read: it (or its metadata path) must not be a directory or
another non-regular file, must not be one of the sources, and must lie in a directory that can be made and
written. All files are written under temporary names and published when complete, each token file after its
metadata (the held-out pair first), so a failed or interrupted run never leaves a new token file without its
metadata (the reader, ``hybrid.data.tokens.TokenFile``, needs both): a new ``--out`` gets both files or
neither; a replaced one whose token file's rename fails keeps its old token file without metadata, which the
reader refuses with a sentence saying to prepare it again. Bad input (``hybrid.data.documents``), sources
without a single token, a tokenizer that does not load or has no end of text where one is needed, an
``eval_fraction`` outside (0, 1) or holding out no document, an output that cannot be written (any ``OSError``
writing it): one ``DataError`` sentence each.
"""

from __future__ import annotations

import contextlib
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence

import numpy as np

from hybrid.data.documents import Piece, Source, check_parquet, expand_sources, read
from hybrid.data.encoders import ByteTokenizer, JsonTokenizer, load_tokenizer  # noqa: F401  (re-exported)
from hybrid.data.tokens import DTYPES, TokenFileMeta, dtype_for, metadata_path, unigram_entropy
from hybrid.errors import DataError, listing

BATCH_BYTES = 1 << 18  # about this much document text is encoded at once (a tokenizer's encodings: ~100 B a token)
BATCH_DOCS = 4096


@dataclass(frozen=True)
class Progress:
    """How far a run is: files finished of all, documents and tokens written, source bytes read of all."""

    files: int
    files_total: int
    documents: int
    tokens: int
    bytes_read: int
    bytes_total: int


def eval_path(out: str | os.PathLike) -> Path:
    """Where ``--eval-fraction`` writes the held-out documents of ``out``: ``corpus.bin`` → ``corpus.eval.bin``
    (``corpus`` → ``corpus.eval``)."""
    out = Path(out)
    return out.with_name(f"{out.stem}.eval{out.suffix}" if out.suffix else f"{out.name}.eval")


def held_out(index: int, fraction: float) -> bool:
    """Whether document ``index`` (from 0) goes to the held-out file: ``floor(N F)`` of the first ``N``."""
    return math.floor((index + 1) * fraction) > math.floor(index * fraction)


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
                raise DataError(f"--out {out} would overwrite the source {source}{what}; give --out a path "
                                "that is not one of the sources.")


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
            *, text_field: str = "text", eot: Optional[str] = None, eval_fraction: Optional[float] = None,
            progress: Optional[Callable[[Progress], None]] = None) -> TokenFileMeta:
    """Tokenise ``sources`` into the token file ``out`` and its metadata (and the held-out file, with
    ``eval_fraction``); ``progress(Progress)`` is called after every batch and file. Returns the metadata of
    ``out``. All output files are opened before any text is read; on any failure no temporary file is left."""
    if eval_fraction is not None and not 0 < eval_fraction < 1:
        raise DataError(f"--eval-fraction {eval_fraction} is not between 0 and 1; give the share of documents to "
                        "hold out, e.g. 0.01.")
    found = expand_sources(sources)
    paths = [s.path for s in found]
    out = check_out(out, paths)
    targets = [out] + ([check_out(eval_path(out), paths)] if eval_fraction is not None else [])
    tok = load_tokenizer(tokenizer, eot, need_eot=any(s.records for s in found))
    check_parquet(found, text_field)
    outputs = [_Output(path, tok.vocab_size) for path in targets]
    try:
        with contextlib.ExitStack() as stack:
            for output in outputs:
                output.open(stack)
            _Run(tok, outputs, eval_fraction, progress).all(found, text_field)
            _check_counts(outputs, paths, eval_fraction)
            metas = [o.finish(tok, tuple(p.name for p in paths)) for o in outputs]
        for output in reversed(outputs):  # the held-out pair first: --out's own is the last to appear
            _publish(output.tmp, output.meta_tmp, output.path)
        return metas[0]
    except OSError as err:
        raise _write_error(out, err) from None
    finally:
        for output in outputs:
            for leftover in (output.tmp, output.meta_tmp):
                with contextlib.suppress(OSError):
                    leftover.unlink(missing_ok=True)


class _Output:
    """One token file being written: its temporaries, token counts and documents."""

    def __init__(self, path: Path, vocab_size: int):
        self.path, (self.tmp, self.meta_tmp) = path, temporary_paths(path)
        self.dtype = dtype_for(vocab_size)
        self.counts = np.zeros(vocab_size, dtype=np.int64)
        self.tokens = self.documents = 0
        self.pending: list[np.ndarray] = []

    def open(self, stack: contextlib.ExitStack) -> None:
        self.sink = stack.enter_context(open(self.tmp, "wb"))
        self.meta_sink = stack.enter_context(open(self.meta_tmp, "w"))

    def flush(self) -> None:
        if self.pending:
            ids = np.concatenate(self.pending)
            self.pending = []
            self.sink.write(ids.astype(DTYPES[self.dtype]).tobytes())
            self.counts += np.bincount(ids, minlength=self.counts.size)
            self.tokens += int(ids.size)

    def finish(self, tok, sources: tuple) -> TokenFileMeta:
        meta = TokenFileMeta(dtype=self.dtype, vocab_size=self.counts.size, tokens=self.tokens, tokenizer=tok.name,
                             unigram_entropy_nats=unigram_entropy(self.counts), sources=sources,
                             documents=self.documents, eot=tok.eot)
        self.meta_sink.write(meta.to_json())
        return meta


class _Run:
    """The documents of all sources, encoded a batch at a time and appended to their output."""

    def __init__(self, tok, outputs: list[_Output], fraction: Optional[float], progress):
        self.tok, self.outputs, self.fraction, self.progress = tok, outputs, fraction, progress
        self.eot = None if tok.eot is None else np.array([tok.eot], dtype=np.int64)
        self.index, self.target = 0, None  # the next document's index; the output of the one being read
        self.files, self.files_total = 0, 0
        self.done_bytes, self.file_bytes, self.total_bytes = 0, 0, 0

    def all(self, sources: Sequence[Source], field: str) -> None:
        sizes = [s.path.stat().st_size for s in sources]
        self.files_total, self.total_bytes = len(sources), sum(sizes)
        for source, size in zip(sources, sizes):
            batch, text = [], 0
            for piece in read(source, field, whole_text=not self.tok.streams):
                batch.append(piece)
                text += len(piece.data)
                if text >= BATCH_BYTES or len(batch) >= BATCH_DOCS:
                    self._encode(batch, source, size)
                    batch, text = [], 0
            self._encode(batch, source, size)
            self.files, self.done_bytes, self.file_bytes = self.files + 1, self.done_bytes + size, 0
            self._report()

    def _encode(self, batch: list[Piece], source: Source, size: int) -> None:
        if not batch:
            return
        vocab = self.tok.vocab_size
        for piece, ids in zip(batch, self.tok.encode_batch([p.data for p in batch], source.path)):
            if ids.size and int(ids.max()) >= vocab:
                raise DataError(f"the tokenizer produced id {int(ids.max())} for {source.path}, not below its "
                                f"vocab_size {vocab}; the tokenizer.json is inconsistent.")
            if self.target is None:  # a document starts
                held = self.fraction is not None and held_out(self.index, self.fraction)
                self.target = self.outputs[1 if held else 0]
            self.target.pending.append(ids)
            if piece.ends:
                if self.eot is not None:
                    self.target.pending.append(self.eot)
                self.target.documents += 1
                self.index, self.target = self.index + 1, None
        for output in self.outputs:
            output.flush()
        self.file_bytes = min(size, self.file_bytes + sum(p.consumed for p in batch))
        self._report()

    def _report(self) -> None:
        if self.progress is not None:
            self.progress(Progress(self.files, self.files_total, self.index, sum(o.tokens for o in self.outputs),
                                   self.done_bytes + self.file_bytes, self.total_bytes))


def _check_counts(outputs: list[_Output], paths: Sequence[Path], fraction: Optional[float]) -> None:
    """Raises ``DataError`` if an output holds no tokens (or, held out, no document)."""
    if outputs[0].tokens == 0:
        raise DataError(f"the sources given ({listing(str(p) for p in paths)}) hold no tokens; pass non-empty "
                        "files.")
    if fraction is None:
        return
    documents, held = sum(o.documents for o in outputs), outputs[1]
    if held.documents == 0:
        fix = f"raise it to at least {1 / documents:.3g}" if documents > 1 else "give more documents"
        raise DataError(f"--eval-fraction {fraction} holds out none of the {documents} document(s) (one in every "
                        f"{1 / fraction:.3g}); {fix}.")
    if held.tokens == 0:
        raise DataError(f"the {held.documents} document(s) --eval-fraction {fraction} holds out hold no tokens; "
                        "raise it or give documents with text.")


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
