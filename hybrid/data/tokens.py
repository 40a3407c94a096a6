"""Token files: flat binary token ids on disk, memory-mapped, sampled deterministically per step.

A token file is what nanoGPT and llm.c train on: token ids back to back, ``uint16`` (vocabularies up to
65,536) or ``uint32``, little-endian, no header. Beside it, ``<file>.json`` (``metadata_path``) records
the dtype, the vocabulary size, the token count, the tokenizer and the unigram entropy of the tokens, and
(when known) the number of documents and the end-of-text id that ends each one (absent or null in older
files, which read as before); ``hybrid data prepare`` writes both. ``TokenFile(path, seq_len, seed)`` opens
one with ``numpy.memmap`` (nothing is read into memory but the rows a batch needs) after checking it against
its metadata: a missing, empty, truncated or out-of-vocabulary file is a ``DataError`` of one sentence.

Sampling: the file is cut into windows of ``seq_len + 1`` tokens; a window is one row (inputs, and the
targets shifted by one). Every epoch shifts the cut by an offset in ``[0, seq_len]`` and visits the windows
in a fresh pseudo-random order -- a Feistel-network permutation of the window indices keyed by (seed,
epoch), computed per index, so no permutation table is ever held. Step ``s`` takes the ``rows = micro_batch
· dp`` consecutive positions of that order that belong to it (a step never straddles two epochs) and DP
rank ``r`` takes rows ``r · micro_batch ...``: a batch is a pure function of (seed, step, DP rank and
size), so a resumed job sees exactly the batches an uninterrupted one would, and the DP ranks of a step
always read disjoint tokens.

``span=(start, stop)`` opens only tokens ``[start, stop)`` of the file (the whole file is still checked against
its metadata): every window, offset and count above is then the span's, so a stream over ``(0, cut)`` never
reads a token at or after ``cut`` -- how a held-out tail is kept out of training (``hybrid.runtime.evaluate``).
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from hybrid.errors import DataError

FORMAT = "hybrid-tokens/1"
DTYPES = {"uint16": "<u2", "uint32": "<u4"}
SCAN_CHUNK = 1 << 24  # tokens per chunk when scanning a file for its largest id


@dataclass(frozen=True)
class TokenFileMeta:
    """What ``<file>.json`` records about a token file."""

    dtype: str
    vocab_size: int
    tokens: int
    tokenizer: str = "bytes"
    unigram_entropy_nats: Optional[float] = None
    sources: tuple = ()
    documents: Optional[int] = None  # None: not recorded (metadata written before documents were counted)
    eot: Optional[int] = None  # the end-of-text id that ends every document; None: documents are not separated

    def to_json(self) -> str:
        return json.dumps({"format": FORMAT, **asdict(self), "sources": list(self.sources)}, indent=2) + "\n"


def metadata_path(path: str | os.PathLike) -> Path:
    """Where the metadata of token file ``path`` lives: ``path`` with ``.json`` appended."""
    path = Path(path)
    return path.with_name(path.name + ".json")


def dtype_for(vocab_size: int) -> str:
    """The smallest dtype that holds every id of a vocabulary of ``vocab_size`` tokens."""
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


def unigram_entropy(counts: np.ndarray) -> float:
    """Entropy in nats of the token distribution with the given counts: the loss of a model that knows
    only how often each token occurs. Never negative: a single token's 0 is +0.0, not -0.0."""
    counts = np.asarray(counts, dtype=np.float64)
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum()) + 0.0  # + 0.0 turns -0.0 (one token: -(1 * log 1)) into 0.0


def read_metadata(path: Path, shown: Optional[Path] = None) -> TokenFileMeta:
    """The metadata beside token file ``path``; errors name the file as ``shown`` (default ``path``)."""
    shown = Path(shown or path)
    meta_file, meta_shown = metadata_path(path), metadata_path(shown)
    try:
        doc = json.loads(meta_file.read_text())
        fields = {k: doc[k] for k in ("dtype", "vocab_size", "tokens")}
    except FileNotFoundError:
        raise DataError(f"token file {shown} has no metadata file {meta_file.name} beside it; write both with "
                        f"`hybrid data prepare TEXT... --out {shown}`.") from None
    except (json.JSONDecodeError, KeyError, TypeError) as err:
        raise DataError(f"{meta_shown} is not token-file metadata ({type(err).__name__}: {err}); write it again "
                        "with `hybrid data prepare`.") from None
    if fields["dtype"] not in DTYPES:
        raise DataError(f"{meta_shown} says dtype {fields['dtype']!r}; a token file is uint16 or uint32.")
    limit = 2 ** (16 if fields["dtype"] == "uint16" else 32)
    for key, low in (("vocab_size", 1), ("tokens", 0)):
        value = fields[key]
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise DataError(f"{meta_shown} says {key} {value!r}; it must be a whole number >= {low}; write it "
                            "again with `hybrid data prepare`.")
    if fields["vocab_size"] > limit:
        raise DataError(f"{meta_shown} says vocab_size {fields['vocab_size']} for {fields['dtype']} ids, which hold "
                        f"at most {limit}; write it again with `hybrid data prepare`.")
    entropy, sources = doc.get("unigram_entropy_nats"), doc.get("sources", ())
    if entropy is not None and (isinstance(entropy, bool) or not isinstance(entropy, (int, float))):
        raise DataError(f"{meta_shown} says unigram_entropy_nats {entropy!r}; it must be a number (or absent).")
    if not isinstance(sources, (list, tuple)):
        raise DataError(f"{meta_shown} says sources {sources!r}; it must be a list of file names (or absent).")
    documents, eot = doc.get("documents"), doc.get("eot")
    for key, value, high in (("documents", documents, None), ("eot", eot, fields["vocab_size"])):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0
                                  or (high is not None and value >= high)):
            bound = f" below vocab_size {high}" if high is not None else ""
            raise DataError(f"{meta_shown} says {key} {value!r}; it must be a whole number >= 0{bound} (or absent); "
                            "write it again with `hybrid data prepare`.")
    return TokenFileMeta(**fields, tokenizer=str(doc.get("tokenizer", "unknown")),
                         unigram_entropy_nats=entropy, sources=tuple(sources), documents=documents, eot=eot)


# ------------------------------------------------------------------------------------------ permutation

_GOLDEN = 0x9E3779B97F4A7C15


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser on uint64 arrays (wrapping arithmetic): a cheap, well-spread hash."""
    with np.errstate(over="ignore"):
        x = x ^ (x >> np.uint64(30))
        x = x * np.uint64(0xBF58476D1CE4E5B9)
        x = x ^ (x >> np.uint64(27))
        x = x * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


def _key(seed: int, epoch: int) -> np.uint64:
    return _mix(np.array([(seed * _GOLDEN + epoch * 0x632BE59BD9B4E019 + 1) % 2**64], dtype=np.uint64))[0]


def permute(indices: np.ndarray, n: int, key: np.uint64, rounds: int = 4) -> np.ndarray:
    """A bijection of ``[0, n)`` applied to ``indices``: a balanced Feistel network over the smallest
    even number of bits covering ``n``, cycle-walking until the value falls inside ``[0, n)``."""
    half = max(1, ((n - 1).bit_length() + 1) // 2)
    mask = np.uint64((1 << half) - 1)
    shift = np.uint64(half)
    round_keys = [_key(int(key), r) for r in range(rounds)]

    def once(x: np.ndarray) -> np.ndarray:
        left, right = x >> shift, x & mask
        for k in round_keys:
            left, right = right, left ^ (_mix(right ^ k) & mask)
        return (left << shift) | right

    out = once(np.asarray(indices, dtype=np.uint64))
    outside = out >= np.uint64(n)
    while outside.any():
        out[outside] = once(out[outside])
        outside = out >= np.uint64(n)
    return out.astype(np.int64)


# ------------------------------------------------------------------------------------------- the file


class TokenFile:
    """A token file opened for training rows of ``seq_len`` tokens (plus one for the targets)."""

    def __init__(self, path: str | os.PathLike, seq_len: int, seed: int = 0, *, dtype: Optional[str] = None,
                 vocab_size: Optional[int] = None, check: bool = True, shown_as: Optional[str | os.PathLike] = None,
                 span: Optional[tuple[int, int]] = None):
        self.path = Path(path)
        self.shown = Path(shown_as) if shown_as is not None else self.path  # how errors name it (the user's path)
        if not self.path.exists():
            raise DataError(f"data file {self.shown} does not exist; create it with "
                            f"`hybrid data prepare TEXT... --out {self.shown}`.")
        if self.path.is_dir():
            raise DataError(f"data file {self.shown} is a directory; give the path of a token file "
                            "(made by `hybrid data prepare`).")
        if dtype is not None and vocab_size is not None:  # a raw file without metadata (nanoGPT's .bin)
            self.meta = TokenFileMeta(dtype=dtype, vocab_size=int(vocab_size), tokens=-1, tokenizer="unknown")
        else:
            self.meta = read_metadata(self.path, self.shown)
        if self.meta.dtype not in DTYPES:
            raise DataError(f"dtype {self.meta.dtype!r} of {self.shown} is not a token dtype; use uint16 or uint32.")
        if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1:
            raise ValueError(f"TokenFile needs seq_len >= 1, got {seq_len!r}")
        self.seq_len, self.seed = seq_len, seed
        self.tokens = self._token_count()
        start, stop = span if span is not None else (0, self.tokens)
        if not 0 <= start < stop <= self.tokens:
            raise ValueError(f"TokenFile span must lie inside the file's {self.tokens} tokens, got {span!r}")
        self.span, self.tokens = (start, stop), stop - start
        self.window = seq_len + 1
        self.windows_per_epoch = (self.tokens - self.window + 1) // self.window
        if self.windows_per_epoch < 1:  # each epoch cuts at an offset of up to seq_len tokens
            raise DataError(f"data file {self.shown} holds {self.tokens} tokens, too few for one row of seq_len "
                            f"{seq_len} at every epoch's offset; give it at least {2 * self.window - 1} tokens or "
                            "lower model.seq_len.")
        self._data = np.memmap(self.path, dtype=DTYPES[self.meta.dtype], mode="r", shape=(self.tokens,),
                               offset=start * np.dtype(DTYPES[self.meta.dtype]).itemsize)
        self.origin = (0, 0, 0)  # (step, epoch, position) the counting of steps starts from (``continue_from``)
        if check:
            self._check_ids()

    @property
    def vocab_size(self) -> int:
        return self.meta.vocab_size

    @property
    def unigram_entropy(self) -> float:
        """The file's unigram entropy in nats (from its metadata, else counted)."""
        if self.meta.unigram_entropy_nats is not None:
            return float(self.meta.unigram_entropy_nats)
        counts = np.zeros(self.vocab_size, dtype=np.int64)
        for start in range(0, self.tokens, SCAN_CHUNK):
            counts += np.bincount(self._data[start:start + SCAN_CHUNK], minlength=self.vocab_size)
        return unigram_entropy(counts)

    def _token_count(self) -> int:
        size = self.path.stat().st_size
        itemsize = np.dtype(DTYPES[self.meta.dtype]).itemsize
        if size == 0:
            raise DataError(f"data file {self.shown} is empty; prepare it again from non-empty text with "
                            "`hybrid data prepare`.")
        if size % itemsize:
            raise DataError(f"data file {self.shown} has {size} bytes, not a whole number of {self.meta.dtype} "
                            f"tokens ({itemsize} bytes each); it is truncated or of another dtype, so prepare it "
                            "again.")
        count = size // itemsize
        if self.meta.tokens >= 0 and count != self.meta.tokens:
            raise DataError(f"data file {self.shown} holds {count} tokens but {metadata_path(self.path).name} says "
                            f"{self.meta.tokens}; the file changed after it was prepared, so prepare it again.")
        return count

    def _check_ids(self) -> None:
        for start in range(0, self.tokens, SCAN_CHUNK):
            chunk = self._data[start:start + SCAN_CHUNK]
            if int(chunk.max()) >= self.vocab_size:
                i = int(np.argmax(chunk >= self.vocab_size))
                raise DataError(f"data file {self.shown} holds token id {int(chunk[i])} at position "
                                f"{self.span[0] + start + i}, "
                                f"not below its vocab_size {self.vocab_size}; prepare the file again with the "
                                "tokenizer it is meant for.")

    # ------------------------------------------------------------------------------------- sampling

    def starts(self, step: int, rows: int) -> np.ndarray:
        """Token offsets of the ``rows`` windows of ``step``'s global batch (distinct, non-overlapping)."""
        n = self.windows_per_epoch
        if rows > n:
            raise DataError(f"data file {self.shown} holds {n} rows of seq_len {self.seq_len}, fewer than the "
                            f"{rows} one step needs (micro_batch x gradient accumulation x dp); use more text or "
                            "a smaller job.micro_batch.")
        epoch, first = self._place(step, rows, self.origin)
        key = _key(self.seed, epoch)
        offset = int(_mix(np.array([int(key)], dtype=np.uint64))[0] % np.uint64(self.window))
        positions = first + np.arange(rows, dtype=np.int64)
        return offset + permute(positions, n, key) * self.window

    def _place(self, step: int, rows: int, origin: tuple) -> tuple[int, int]:
        """(epoch, first position in it) of ``step``'s ``rows`` rows, steps counted from ``origin`` = (step,
        epoch, position) onwards: the rest of that epoch first, then whole epochs of ``n // rows`` steps (a
        remainder of fewer than ``rows`` rows is left out of an epoch; the next one's order differs)."""
        n = self.windows_per_epoch
        s0, e0, w0 = origin if step >= origin[0] else (0, 0, 0)
        k, first_steps = step - s0, (n - w0) // rows
        if k < first_steps:
            return e0, w0 + k * rows
        epoch, within = divmod(k - first_steps, n // rows)
        return e0 + 1 + epoch, within * rows

    def data_state(self, rows: int) -> dict:
        """What a checkpoint keeps to continue this stream (``continue_from``): the rows of every step and
        where this run's counting of steps started."""
        return {"data_rows_per_step": rows, "data_origin": list(self.origin)}

    def continue_from(self, step: int, state: dict) -> None:
        """Continue a run checkpointed after ``step`` steps with ``state`` (``data_state``): later steps read
        the rows after the ones it read, whatever their own row count (a resume may change micro_batch, the
        accumulation or the DP size); with an unchanged row count, exactly what an uninterrupted run reads."""
        rows, origin = state.get("data_rows_per_step"), tuple(state.get("data_origin") or (0, 0, 0))
        if not rows:
            return
        self.origin = (int(step), *self._place(int(step), int(rows), origin))

    def global_batch(self, step: int, rows: int) -> torch.Tensor:
        """``rows`` windows of ``seq_len + 1`` tokens for ``step``, the same on every call."""
        return self._rows(self.starts(step, rows))

    def batch(self, step: int, micro_batch: int, dp_rank: int = 0, dp: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets) of DP rank ``dp_rank``: its ``micro_batch`` rows of the step's global batch of
        ``micro_batch · dp`` rows; targets are the inputs shifted by one token."""
        if micro_batch < 1 or dp < 1 or not 0 <= dp_rank < dp:
            raise ValueError(f"TokenFile.batch needs micro_batch >= 1 and 0 <= dp_rank < dp, got micro_batch "
                             f"{micro_batch}, dp_rank {dp_rank}, dp {dp}")
        starts = self.starts(step, micro_batch * dp)[dp_rank * micro_batch:(dp_rank + 1) * micro_batch]
        rows = self._rows(starts)
        return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()

    def _rows(self, starts: np.ndarray) -> torch.Tensor:
        windows = self._data[starts[:, None] + np.arange(self.window, dtype=np.int64)]
        return torch.from_numpy(windows.astype(np.int64))
