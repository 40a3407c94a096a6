"""``hybrid checkpoint``: look at a run's checkpoints and turn one into a plain state dict, offline.

* ``hybrid checkpoint inspect RUN_DIR [--json] [--sizes-only]``: every checkpoint directory (complete,
  being written or interrupted, published without its marker), its step, the world layout it was saved
  with (world size, dp, tp, ZeRO stage, precision), its size on disk, and which one a resume would use.
  RUN_DIR may also be its ``checkpoints/`` directory or one checkpoint directory (under any name).
  Every published checkpoint is verified against the checksums of its manifest (every byte is read;
  ``--sizes-only`` checks file sizes alone) and a damaged one shows its first problem as its status:
  ``corrupt: FILE``, ``truncated: FILE``, ``missing: FILE`` or ``unreadable: FILE`` (permissions: a
  resume stops there). Listing damaged checkpoints is a success (exit 0); the answer is the table.
* ``hybrid checkpoint consolidate PATH --out model.pt [--format pt|safetensors]``: PATH is a run directory
  or its ``checkpoints/`` directory (the checkpoint a resume would use: the newest verified one, which the
  output line names) or one checkpoint directory, under any name; writes the single-process ``state_dict``
  (every name of ``module.state_dict()``: parameters and float buffers as fp32, tied aliases included),
  loadable with ``torch.load(path, weights_only=True)`` and a strict ``load_state_dict`` into the
  single-process model; or a ``.safetensors`` file (tied aliases left out: safetensors shares no
  storage). Either loads with ``hybrid.initialize(..., weights=PATH)``.
  It refuses a damaged checkpoint and one whose weights are not finite, and checks that ``--out`` can be
  written, and lies outside every checkpoint directory, before it reads anything.
* ``hybrid checkpoint consolidate PATH --hf OUT_DIR [--config config.json] [--max-shard-size 5GB]``: the same
  weights as a Hugging Face ``save_pretrained`` directory (``hybrid.checkpoint.consolidate_hf``): sharded
  safetensors ``model-00001-of-0000N.safetensors``, their ``model.safetensors.index.json`` and the model's
  ``config.json`` (``--config``, else the checkpoint's model config when it is a transformers one), streamed
  a tensor at a time; ``from_pretrained(OUT_DIR)`` and ``weights=OUT_DIR`` load it. OUT_DIR must not exist (or
  be empty) and lie outside every checkpoint directory; it appears complete or not at all.

Both run in one process with no process group. A path that is not a checkpoint, a damaged one, or an
``--out`` or ``--hf`` that cannot be written ends with one ``error: ...`` line and exit status 2.
"""

from __future__ import annotations

import contextlib
import errno
import json
from pathlib import Path

import click

from hybrid.config.units import human_bytes
from hybrid.errors import CheckpointError, UsageError


def _layout_text(world: dict | None) -> str:
    if not world:
        return "-"
    return f"dp {world['dp']} × tp {world['tp']}, stage {world['stage']}, {world['precision']}"


@click.group("checkpoint")
def checkpoint_group() -> None:
    """Inspect a run's checkpoints or consolidate one into a single state dict."""


@checkpoint_group.command("inspect")
@click.argument("run_dir", type=click.Path(path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of the table.")
@click.option("--sizes-only", is_flag=True, help="Check file sizes only, not checksums (reads no data).")
def inspect_command(run_dir: Path, as_json: bool, sizes_only: bool) -> None:
    """List the checkpoints of RUN_DIR: status (verified), step, world layout, size on disk."""
    from hybrid.checkpoint import describe

    info = describe(run_dir, checksums=not sizes_only)
    if as_json:
        click.echo(json.dumps(info))
        return
    rows = [["NAME", "STEP", "STATUS", "LAYOUT", "SIZE"]]
    for row in info["checkpoints"]:
        rows.append([row["name"], "-" if row["step"] is None else str(row["step"]), row["status"], _layout_text(row.get("world")),
                     human_bytes(row["bytes"])])
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    click.echo(f"{info['run_dir']}: {len(info['checkpoints'])} checkpoint director"
               f"{'y' if len(info['checkpoints']) == 1 else 'ies'}")
    for r in rows:
        click.echo("  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip())
    latest = info["latest"]
    if info.get("resume_stops"):
        click.echo(f"resume stops: {info['resume_stops']}")
    else:
        click.echo(f"resume uses: {latest}" if latest else "resume uses: nothing (no good checkpoint)")


@checkpoint_group.command("consolidate")
@click.argument("path", type=click.Path(path_type=Path))
@click.option("--out", "out", type=click.Path(path_type=Path, dir_okay=False), default=None,
              help="Where to write the single-process state dict.")
@click.option("--format", "fmt", type=click.Choice(["pt", "safetensors"]), default=None,
              help="torch.save (pt) or safetensors; default: from the --out suffix (.safetensors), else pt.")
@click.option("--hf", "hf_dir", type=click.Path(path_type=Path), default=None,
              help="Write a Hugging Face save_pretrained directory here instead (sharded safetensors, index, "
                   "config.json).")
@click.option("--config", "hf_config", type=click.Path(path_type=Path), default=None,
              help="With --hf: the model's config.json (default: the checkpoint's model config, if a "
                   "transformers one).")
@click.option("--max-shard-size", default=None,
              help="With --hf: the largest shard file, e.g. 500MB (default: 5GB, huggingface_hub's).")
def consolidate_command(path: Path, out: Path | None, fmt: str | None, hf_dir: Path | None, hf_config: Path | None,
                        max_shard_size: str | None) -> None:
    """Write the single-process state dict (fp32 params, buffers, tied aliases) of PATH's latest (or the given) checkpoint to --out, or a Hugging Face directory to --hf."""
    if (out is None) == (hf_dir is None):
        raise UsageError("hybrid checkpoint consolidate needs one of --out FILE (a state dict) or --hf DIR (a Hugging "
                         "Face directory)" + (", not both." if out is not None else "."))
    if hf_dir is None and (hf_config is not None or max_shard_size is not None):
        flag = "--config" if hf_config is not None else "--max-shard-size"
        raise UsageError(f"{flag} is an option of --hf DIR (a Hugging Face directory); give --hf DIR with it, or leave "
                         f"it out.")
    if hf_dir is not None:
        _consolidate_hf(path, hf_dir, hf_config, max_shard_size, fmt)
        return
    import torch

    from hybrid.checkpoint import consolidate

    fmt = fmt or ("safetensors" if out.suffix == ".safetensors" else "pt")
    _outside_checkpoints(out)
    tmp = out.with_name(out.name + ".tmp")
    with _writable(out, tmp) as f:
        state, ckpt, doc = consolidate(path)
        if fmt == "pt":
            torch.save(state, f)
        else:
            # safetensors stores no shared tensors: a tied alias is left out (hybrid's loader accepts that).
            from safetensors.torch import save_file

            f.close()
            tensors = {k: v.contiguous() for k, v in state.items() if k not in doc["aliases"]}
            save_file(tensors, str(tmp), metadata={"format": "pt", "step": str(doc["step"])})
            state = tensors
    tmp.replace(out)
    params = sum(state[k].numel() for k in (*doc["params"], *doc.get("frozen", {})))  # a tied weight once, no buffers
    click.echo(f"wrote {out}: {len(state)} tensors, {params:,} parameters (fp32) from {ckpt} "
               f"(step {doc['step']}, saved at {_layout_text(doc['world'])})")


def _consolidate_hf(path: Path, out_dir: Path, config: Path | None, max_shard_size: str | None,
                    fmt: str | None) -> None:
    from hybrid.checkpoint import consolidate_hf

    if fmt is not None:
        raise UsageError("--format chooses the file type of --out; --hf always writes safetensors, so leave it out.")
    size = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    done = consolidate_hf(path, out_dir, config=config, **size)
    shards = done.shards[0] if len(done.shards) == 1 else f"{done.shards[0]} .. {done.shards[-1]}"
    config_text = (f", config.json (from {done.config_from})" if done.config_from else
                   ", no config.json (the checkpoint names none: --config adds one)")
    doc = done.manifest
    click.echo(f"wrote {out_dir}: {shards}, {done.files[len(done.shards)]}{config_text}; {done.tensors} tensors, "
               f"{done.parameters:,} parameters (fp32, {human_bytes(done.total_size)}) from {done.checkpoint} "
               f"(step {doc['step']}, saved at {_layout_text(doc['world'])})")


def _outside_checkpoints(out: Path) -> None:
    """Refuse an ``--out`` inside a checkpoint directory or a run's ``checkpoints/`` (it would overwrite a
    checkpoint's file, or add one that makes it fail verification), symlinks followed."""
    from hybrid.checkpoint.offline import inside_checkpoint

    parent = inside_checkpoint(out)
    if parent is not None:
        raise CheckpointError(f"--out {out} lies inside the checkpoint directory {parent}, which writing it "
                              f"would damage; write the state dict outside it (e.g. --out model.pt).")


@contextlib.contextmanager
def _writable(out: Path, tmp: Path):
    """``tmp`` opened for writing (checked before the checkpoint is read), removed unless the body succeeds."""
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        f = open(tmp, "wb")
    except OSError as exc:
        why = "a parent is not a directory" if exc.errno in (errno.EEXIST, errno.ENOTDIR) else exc.strerror or exc
        raise CheckpointError(f"cannot write --out {out}: {why}; choose a writable path.") from None
    try:
        with f:
            yield f
    except OSError as exc:  # disk full, quota, I/O error while writing
        tmp.unlink(missing_ok=True)
        raise CheckpointError(f"cannot write --out {out}: {exc.strerror or exc}; choose a writable path "
                              f"with room for the state dict.") from None
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
