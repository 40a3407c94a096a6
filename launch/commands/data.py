"""``hybrid data prepare TEXT... --out FILE [--tokenizer tokenizer.json]``: text files → a token file.

Tokenises the files in order (byte-level by default; a ``tokenizer.json`` through the ``tokenizers``
package) into ``FILE`` plus its metadata ``FILE.json`` (``hybrid.data.prepare``), with a progress bar on a
terminal, and ends with one line: tokens, vocabulary, dtype and the unigram entropy a model must beat.
Bad input is one ``error:`` sentence and exit status 2.
"""

from __future__ import annotations

import math
import sys

import click

from hybrid.data.prepare import check_sources, prepare
from hybrid.data.tokens import metadata_path


@click.group("data")
def data_group() -> None:
    """Prepare training data: token files from text."""


@data_group.command("prepare")
@click.argument("text", nargs=-1, type=click.Path(path_type=str))
@click.option("--out", required=True, type=click.Path(path_type=str), help="The token file to write (e.g. train.bin).")
@click.option("--tokenizer", type=click.Path(path_type=str), default=None,
              help="A tokenizer.json (needs the tokenizers package); default: byte-level, vocabulary 256.")
def prepare_command(text: tuple, out: str, tokenizer: str | None) -> None:
    """Tokenise the TEXT files into the token file --out and its metadata (--out + .json)."""
    paths = check_sources(text)
    total = sum(p.stat().st_size for p in paths)
    if sys.stderr.isatty():
        with click.progressbar(length=total, label="tokenising", file=sys.stderr) as bar:
            meta = prepare(paths, out, tokenizer=tokenizer, progress=bar.update)
    else:  # a log or a pipe: the closing line is enough
        meta = prepare(paths, out, tokenizer=tokenizer)
    click.echo(f"wrote {out}: {meta.tokens:,} tokens ({meta.dtype}, vocabulary {meta.vocab_size}, tokenizer "
               f"{meta.tokenizer}) from {len(paths)} file(s); unigram entropy {meta.unigram_entropy_nats:.3f} nats "
               f"({meta.unigram_entropy_nats / math.log(2):.3f} bits) per token; metadata {metadata_path(out)}")
