"""Tokenizers for ``hybrid data prepare``: bytes, or a ``tokenizer.json``; and the end-of-text token.

``ByteTokenizer``: every byte is one token (ids 0-255), so any input, UTF-8 or not, tokenises and ``decode``
gives its bytes back; with an end of text (``with_eot``) the vocabulary grows to 257 and id 256
(``BYTE_EOT``) ends a document. ``JsonTokenizer``: a ``tokenizer.json`` loaded with the ``tokenizers``
package (the ``data`` extra); the text must be UTF-8, the vocabulary is the tokenizer's, special tokens
written in a document's text are encoded as the tokenizer itself encodes them, and its end-of-text token is
the one ``--eot`` names, else the first of ``EOT_CANDIDATES`` among its added tokens, else (only when one is
needed) a ``DataError`` saying to pass ``--eot``.

Both encode a batch of documents at once (``encode_batch``: ``str`` or ``bytes`` each, one id array each,
the end of text not appended -- the caller places it) without special tokens of a post-processor (no BOS).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

from hybrid.errors import DataError, first_line, listing

BYTE_EOT = 256  # the byte-level end of text: one past the bytes
# End-of-text tokens of common tokenizers, most specific first (GPT-2/NeoX/Qwen, Llama 3, Llama 2/T5/Mistral,
# Gemma); a chat tokenizer's end-of-turn (``<|eot_id|>``, ``<|im_end|>``) is not an end of document.
EOT_CANDIDATES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eos|>", "[EOS]")


class ByteTokenizer:
    """Every byte is a token: vocabulary 256, or 257 with the end of text ``BYTE_EOT``."""

    name = "bytes"
    streams = True  # a plain text file can be encoded chunk by chunk

    def __init__(self, with_eot: bool = False):
        self.eot: Optional[int] = BYTE_EOT if with_eot else None
        self.vocab_size = 257 if with_eot else 256

    def encode(self, data: bytes, source: Path) -> np.ndarray:
        return np.frombuffer(data, dtype=np.uint8)

    def encode_batch(self, docs: Sequence[str | bytes], source: Path) -> list[np.ndarray]:
        return [np.frombuffer(d.encode("utf-8") if isinstance(d, str) else d, dtype=np.uint8) for d in docs]

    def decode(self, ids) -> bytes:
        return bytes(int(i) for i in ids if int(i) < 256)


class JsonTokenizer:
    """A ``tokenizer.json`` loaded with the ``tokenizers`` package; encodes whole UTF-8 documents."""

    streams = False

    def __init__(self, path: Path, eot: Optional[str] = None, need_eot: bool = False):
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
            raise DataError(f"tokenizer file {path} does not load as a tokenizer.json ({first_line(err)}); give a "
                            "file saved by the tokenizers package.") from None
        self.name = path.name
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.eot = self._eot(path, eot, need_eot)
        self._batch = getattr(self._tok, "encode_batch_fast", self._tok.encode_batch)  # fast: no offsets

    def _eot(self, path: Path, eot: Optional[str], need_eot: bool) -> Optional[int]:
        """The id of the end-of-text token: ``eot`` if given, else (if ``need_eot``) found among the added
        tokens; None when the run does not separate documents."""
        added = {t.content: i for i, t in self._tok.get_added_tokens_decoder().items()}
        if eot is not None:
            found = self._tok.token_to_id(eot)
            if found is None:
                raise DataError(f"--eot {eot!r} is not a token of {path}; pass one of its tokens, e.g. one of its "
                                f"added tokens ({listing(added) or 'it has none'}).")
            return found
        if not need_eot:
            return None
        for candidate in EOT_CANDIDATES:
            if candidate in added:
                return added[candidate]
        raise DataError(f"tokenizer file {path} has no end-of-text token among its added tokens "
                        f"({listing(added) or 'it has none'}; looked for {listing(EOT_CANDIDATES, 6)}); pass "
                        "--eot TOKEN naming the token that ends a document.")

    def encode(self, data: bytes, source: Path) -> np.ndarray:
        return self.encode_batch([data], source)[0]

    def encode_batch(self, docs: Sequence[str | bytes], source: Path) -> list[np.ndarray]:
        texts = [d if isinstance(d, str) else _utf8(d, source) for d in docs]
        return [np.asarray(e.ids, dtype=np.int64) for e in self._batch(texts, add_special_tokens=False)]

    def decode(self, ids) -> str:
        return self._tok.decode([int(i) for i in ids])


def _utf8(data: bytes, source: Path) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise DataError(f"{source} is not UTF-8 text (byte {err.start}); the tokenizer.json needs UTF-8, so "
                        "re-encode the file or leave --tokenizer out to tokenise bytes.") from None


def load_tokenizer(path: Optional[str | os.PathLike], eot: Optional[str] = None, need_eot: bool = False):
    """The tokenizer of a run: bytes (``path`` None) or the ``tokenizer.json`` at ``path``. ``need_eot``: the
    run separates documents, so the tokenizer must have an end of text (bytes: id 256). ``eot`` (``--eot``)
    names it in a ``tokenizer.json`` and implies ``need_eot``."""
    if path is None:
        if eot is not None:
            raise DataError(f"--eot {eot!r} names a token of a --tokenizer; byte-level runs end documents with "
                            f"their own id {BYTE_EOT}, so leave --eot out or pass --tokenizer.")
        return ByteTokenizer(with_eot=need_eot)
    return JsonTokenizer(Path(path), eot, need_eot or eot is not None)
