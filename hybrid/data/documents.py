"""Sources and their documents for ``hybrid data prepare``: files, directories and globs → documents, streamed.

``expand_sources(args)``: each argument is a file, a directory or a glob (``*``, ``?``, ``[``; ``**`` crosses
directories), in the order given; a glob's matches in sorted order; a directory contributes its ``.jsonl``,
``.jsonl.gz``, ``.parquet`` and ``.txt`` files, its subdirectories' too, sorted by path (names starting with
``.`` are left out). A file reached twice is read once, where it first appears. A file's kind is its name's:
``.jsonl``, ``.json`` (read as JSON Lines), ``.jsonl.gz``, ``.json.gz`` are JSON Lines; ``.parquet``,
``.pq`` Parquet; any other name plain text.

``read(source, field, whole_text)`` yields a source's documents as ``Piece``s in order, never holding more
than one record batch: a JSON Lines file line by line, one document per non-blank line (an object whose
``field`` is a string); a Parquet file by record batches of about ``BATCH_BYTES`` of text, only the column
``field`` read (``pyarrow``, the ``data`` extra, imported only for a Parquet file), one document per row; a
plain text file is one document, as bytes, whole when ``whole_text`` (a tokenizer needs it) else in
``READ_CHUNK`` pieces. An empty text is no document. Rows and lines are counted from 1.

Every bad input is one ``DataError`` sentence naming the file, and the line or row and the field where there
is one: a missing source, a glob matching nothing, a directory without such files, a line that is not JSON or
not an object, a record without ``field`` or whose ``field`` is not a string, an unreadable or truncated file,
a Parquet file without a string column ``field`` (``check_parquet``, run before anything is written), a
Parquet file without ``pyarrow`` installed.
"""

from __future__ import annotations

import glob
import gzip
import json
import os
import re
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

from hybrid.errors import DataError, first_line, listing

READ_CHUNK = 1 << 22  # bytes of a plain text file read at a time by the byte-level tokenizer
BATCH_BYTES = 1 << 19  # about this much Parquet text per record batch (arrow holds several times it)
MAX_BATCH_ROWS = 1 << 16
JSONL = (".jsonl", ".json", ".jsonl.gz", ".json.gz")
PARQUET = (".parquet", ".pq")
IN_DIRECTORIES = (".jsonl", ".jsonl.gz", ".parquet", ".txt")
_MAGIC = re.compile(r"[*?[]")
_JSON_TYPES = {dict: "an object", list: "an array", str: "a string", int: "a number", float: "a number",
               bool: "a boolean", type(None): "null"}


@dataclass(frozen=True)
class Source:
    """One file to read and its kind: ``text``, ``jsonl`` or ``parquet``."""

    path: Path
    kind: str

    @property
    def records(self) -> bool:
        """Whether its documents are records (rows, lines) rather than the whole file."""
        return self.kind != "text"


@dataclass(frozen=True)
class Piece:
    """Part of a document (all of it, but for a plain text file read in chunks); ``ends``: its last part;
    ``consumed``: about how many of the file's bytes were read for it (progress only)."""

    data: str | bytes
    ends: bool
    consumed: int


def kind_of(path: Path) -> str:
    name = path.name.lower()
    if name.endswith(JSONL):
        return "jsonl"
    return "parquet" if name.endswith(PARQUET) else "text"


def expand_sources(args: Sequence[str | os.PathLike]) -> list[Source]:
    """The files ``args`` name, in order, each once (see the module docstring); raises ``DataError`` for the
    first argument that names none."""
    if not args:
        raise DataError("no sources given; pass text, JSON Lines or Parquet files, directories of them, or globs.")
    seen, sources = set(), []
    for arg in args:
        for path in _expand(os.fspath(arg)):
            key = os.path.realpath(path)
            if key not in seen:
                seen.add(key)
                sources.append(Source(path, kind_of(path)))
    return sources


def _expand(arg: str) -> list[Path]:
    path = Path(arg)
    if path.is_dir():
        return _directory(path)
    if os.path.lexists(path) or not _MAGIC.search(arg):
        return [_regular(path)]
    matches = sorted(glob.glob(arg, recursive=True))
    if not matches:
        raise DataError(f"glob {arg!r} matches no file; check the pattern, or pass files or directories.")
    return [p for m in matches for p in (_directory(Path(m)) if os.path.isdir(m) else [_regular(Path(m))])]


def _regular(path: Path) -> Path:
    if path.exists() and not path.is_file():
        raise DataError(f"source {path} is not a regular file (a device, FIFO or socket); pass regular files.")
    if not path.is_file():
        raise DataError(f"source {path} does not exist; pass existing files, directories or globs.")
    return path


def _directory(root: Path) -> list[Path]:
    found = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if not d.startswith(".")]
        found += [Path(folder, f) for f in files if not f.startswith(".") and f.lower().endswith(IN_DIRECTORIES)]
    if not found:
        raise DataError(f"directory {root} holds no {', '.join(IN_DIRECTORIES)} file; pass the files in it by "
                        f"name or a glob such as {root}/*.json.")
    return sorted(found, key=lambda p: p.relative_to(root).parts)


def read(source: Source, field: str, whole_text: bool) -> Iterator[Piece]:
    """The documents of ``source`` as pieces, in order (see the module docstring)."""
    if source.kind == "jsonl":
        return _jsonl(source.path, field)
    if source.kind == "parquet":
        return _parquet(source.path, field)
    return _text(source.path, whole_text)


def _unreadable(path: Path, err: BaseException) -> DataError:
    detail = err.strerror if isinstance(err, OSError) and err.strerror else first_line(err, type(err).__name__)
    return DataError(f"cannot read {path} ({detail}); check the file (a truncated copy?) or leave it out.")


def _text(path: Path, whole: bool) -> Iterator[Piece]:
    try:
        with open(path, "rb") as f:
            chunk = f.read() if whole else f.read(READ_CHUNK)
            while chunk:
                following = b"" if whole else f.read(READ_CHUNK)
                yield Piece(chunk, not following, len(chunk))
                chunk = following
    except OSError as err:
        raise _unreadable(path, err) from None


def _jsonl(path: Path, field: str) -> Iterator[Piece]:
    try:
        with open(path, "rb") as raw:
            lines = gzip.GzipFile(fileobj=raw, mode="rb") if path.name.lower().endswith(".gz") else raw
            position = 0
            for number, line in enumerate(lines, 1):
                if not line.strip():
                    continue
                text = _record_text(line, number, path, field)
                consumed, position = raw.tell() - position, raw.tell()
                if text:
                    yield Piece(text, True, consumed)
    except (OSError, EOFError, zlib.error) as err:  # gzip: BadGzipFile is an OSError, a cut stream EOFError
        raise _unreadable(path, err) from None


def _record_text(line: bytes, number: int, path: Path, field: str) -> str:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as err:
        raise DataError(f"line {number} of {path} is not JSON ({err.msg.removesuffix(' at')} at column {err.colno}); fix the line "
                        "or leave the file out.") from None
    except UnicodeDecodeError as err:
        raise DataError(f"line {number} of {path} is not UTF-8 (byte {err.start} of the line); re-encode the "
                        "file as UTF-8.") from None
    if not isinstance(record, dict):
        raise DataError(f"line {number} of {path} is {_JSON_TYPES.get(type(record), 'not an object')}, not a "
                        f"JSON object; each line must be one record such as {{\"{field}\": \"...\"}}.")
    if field not in record:
        raise DataError(f"line {number} of {path} has no field {field!r} (its fields: {listing(record) or 'none'}); "
                        "pass --text-field naming the field that holds the text.")
    text = record[field]
    if not isinstance(text, str):
        raise DataError(f"field {field!r} on line {number} of {path} is {_JSON_TYPES.get(type(text), 'a value')}, "
                        "not a string; fix the record or pass --text-field naming a text field.")
    return text


def _pyarrow(path: Path):
    try:
        import pyarrow
        import pyarrow.parquet
    except ImportError:
        raise DataError(f"{path} is a Parquet file, which needs the pyarrow package; install it with "
                        "`pip install 'hybrid-parallel[data]'` or convert the file to JSON Lines.") from None
    return pyarrow


def _open_parquet(path: Path, field: str):
    """The ``pyarrow.parquet.ParquetFile`` at ``path``, checked to hold a string column ``field``."""
    pa = _pyarrow(path)
    try:
        parquet = pa.parquet.ParquetFile(path, buffer_size=1 << 20)
    except (OSError, pa.ArrowException) as err:
        raise DataError(f"{path} is not a readable Parquet file ({first_line(err)}); check the file (a truncated "
                        "copy?) or leave it out.") from None
    schema = parquet.schema_arrow
    if field not in schema.names:
        raise DataError(f"Parquet file {path} has no column {field!r} (its columns: {listing(schema.names)}); pass "
                        "--text-field naming the column that holds the text.")
    kind = schema.field(field).type
    value = kind.value_type if pa.types.is_dictionary(kind) else kind
    if not (pa.types.is_string(value) or pa.types.is_large_string(value) or getattr(pa.types, "is_string_view",
                                                                                      lambda t: False)(value)):
        raise DataError(f"column {field!r} of Parquet file {path} holds {kind}, not strings; pass --text-field "
                        "naming a string column.")
    return parquet


def check_parquet(sources: Sequence[Source], field: str) -> None:
    """Raises ``DataError`` for the first Parquet source that does not open or has no string column ``field``."""
    for source in sources:
        if source.kind == "parquet":
            _open_parquet(source.path, field).close()


def _batch_rows(parquet, field: str) -> int:
    """Rows per record batch for about ``BATCH_BYTES`` of ``field``'s text (from the file's own statistics)."""
    meta = parquet.metadata
    size = sum(group.column(c).total_uncompressed_size
               for group in (meta.row_group(g) for g in range(meta.num_row_groups))
               for c in range(group.num_columns) if group.column(c).path_in_schema == field)
    per_row = max(1, size // max(1, meta.num_rows))
    return int(min(MAX_BATCH_ROWS, max(1, BATCH_BYTES // per_row)))


def _parquet(path: Path, field: str) -> Iterator[Piece]:
    pa = _pyarrow(path)
    parquet = _open_parquet(path, field)
    size, rows = path.stat().st_size, max(1, parquet.metadata.num_rows)
    row = 0
    try:
        for batch in parquet.iter_batches(batch_size=_batch_rows(parquet, field), columns=[field], use_threads=False):
            column = batch.column(0)
            if column.null_count:
                at = row + 1 + int(column.is_null().to_numpy(zero_copy_only=False).argmax())
                raise DataError(f"field {field!r} on row {at} of Parquet file {path} is null, not a string; drop the "
                                "row or pass --text-field naming a text column.")
            texts = column.to_pylist()
            consumed = size * (row + len(texts)) // rows - size * row // rows
            row += len(texts)
            for i, text in enumerate(texts):
                if text:
                    yield Piece(text, True, consumed if i == 0 else 0)
    except (OSError, pa.ArrowException) as err:
        raise DataError(f"cannot read Parquet file {path} at row {row + 1} ({first_line(err)}); check the file (a "
                        "truncated copy?) or leave it out.") from None
    finally:
        parquet.close()
