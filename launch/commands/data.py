"""``hybrid data prepare SOURCE... --out FILE``: text, JSON Lines and Parquet → a token file.

SOURCEs are files, directories (their ``.jsonl``, ``.jsonl.gz``, ``.parquet`` and ``.txt`` files) and globs;
options: ``--tokenizer tokenizer.json`` (default byte-level), ``--text-field`` (the field or column that holds
a record's text, default ``text``), ``--eot TOKEN`` (the tokenizer's end-of-text token, when it cannot be
found), ``--eval-fraction F`` (hold out whole documents into ``FILE``'s ``.eval`` sibling). What it writes is
``hybrid.data.prepare``'s to say. While it runs, a progress line on stderr (share of the source bytes read,
files, documents, tokens): rewritten in place at most every ``TTY_SECONDS`` on a terminal, a new line every
``LOG_SECONDS`` in a log; it ends with one line per file written: tokens, documents, vocabulary, dtype, end of
text and the unigram entropy a model must beat. Bad input is one ``error:`` sentence and exit status 2.
"""

from __future__ import annotations

import math
import sys
import time
from typing import Optional

import click

from hybrid.config.units import human_bytes
from hybrid.data.prepare import Progress, eval_path, prepare
from hybrid.data.tokens import TokenFileMeta, metadata_path, read_metadata

TTY_SECONDS = 0.5
LOG_SECONDS = 30.0


class ProgressLine:
    """Called with each ``Progress``; writes at most one line per ``every`` seconds to ``stream``, in place on a
    terminal. ``close()`` ends a line written in place."""

    def __init__(self, stream, tty: bool, every: Optional[float] = None):
        self.stream, self.tty = stream, tty
        self.every = (TTY_SECONDS if tty else LOG_SECONDS) if every is None else every
        self.last, self.width = time.monotonic(), 0

    def __call__(self, progress: Progress) -> None:
        now = time.monotonic()
        if now - self.last < self.every:
            return
        self.last = now
        line = describe(progress)
        if self.tty:
            self.stream.write("\r" + line.ljust(self.width))
            self.width = len(line)
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.tty and self.width:
            self.stream.write("\n")
            self.stream.flush()


def describe(p: Progress) -> str:
    """``tokenising: 45% of 1.2 GB read (3/8 files), 120,345 documents, 52,001,234 tokens``."""
    share = 100 * p.bytes_read // p.bytes_total if p.bytes_total else 100
    return (f"tokenising: {share}% of {human_bytes(p.bytes_total)} read ({p.files}/{p.files_total} files), "
            f"{p.documents:,} documents, {p.tokens:,} tokens")


def summary(path, meta: TokenFileMeta, what: str) -> str:
    ends = f", each ended by end of text {meta.eot}" if meta.eot is not None else ""
    plural = "" if meta.documents == 1 else "s"
    bits = meta.unigram_entropy_nats / math.log(2)
    return (f"wrote {path}: {meta.tokens:,} tokens ({meta.dtype}, vocabulary {meta.vocab_size}, tokenizer "
            f"{meta.tokenizer}) from {meta.documents:,} {what}{plural}{ends}; unigram entropy "
            f"{meta.unigram_entropy_nats:.3f} nats ({bits:.3f} bits) per token; metadata {metadata_path(path)}")


@click.group("data")
def data_group() -> None:
    """Prepare training data: token files from text, JSON Lines and Parquet."""


@data_group.command("prepare")
@click.argument("sources", nargs=-1, type=click.Path(path_type=str))
@click.option("--out", required=True, type=click.Path(path_type=str), help="The token file to write (e.g. train.bin).")
@click.option("--tokenizer", type=click.Path(path_type=str), default=None,
              help="A tokenizer.json (needs the tokenizers package); default: byte-level, vocabulary 256 (257 with "
                   "the end of text).")
@click.option("--text-field", default="text", show_default=True,
              help="The JSON Lines field or Parquet column that holds each record's text.")
@click.option("--eot", default=None, metavar="TOKEN",
              help="The --tokenizer's token that ends each document (default: found among its added tokens, e.g. "
                   "<|endoftext|>, </s>, <eos>); with it, plain text files alone are separated too.")
@click.option("--eval-fraction", type=float, default=None, metavar="F",
              help="Hold out this share of whole documents (0 < F < 1, every 1/F-th) into OUT's .eval sibling "
                   "(train.bin -> train.eval.bin).")
def prepare_command(sources: tuple, out: str, tokenizer: Optional[str], text_field: str, eot: Optional[str],
                    eval_fraction: Optional[float]) -> None:
    """Tokenise the SOURCES (text, .jsonl/.jsonl.gz, .parquet files; directories of them; globs) into the token
    file --out and its metadata (--out + .json). Each record and each text file is one document; with any JSON
    Lines or Parquet source (or --eot) every document ends with the end-of-text token."""
    line = ProgressLine(sys.stderr, sys.stderr.isatty())
    try:
        meta = prepare(sources, out, tokenizer=tokenizer, text_field=text_field, eot=eot,
                       eval_fraction=eval_fraction, progress=line)
    finally:
        line.close()
    click.echo(summary(out, meta, "document"))
    if eval_fraction is not None:
        held = eval_path(out)
        click.echo(summary(held, read_metadata(held), "held-out document"))
