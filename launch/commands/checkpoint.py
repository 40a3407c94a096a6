"""``hybrid checkpoint``: look at a run's checkpoints and turn one into a plain state dict, offline.

* ``hybrid checkpoint inspect RUN_DIR [--json]``: every checkpoint directory (complete, being written or
  interrupted, published without its marker), its step, the world layout it was saved with
  (world size, dp, tp, ZeRO stage, precision), its size on disk, and which one a resume would use.
* ``hybrid checkpoint consolidate PATH --out model.pt``: PATH is a run directory (its latest complete
  checkpoint) or one checkpoint directory; writes the single-process ``state_dict`` (every name of
  ``module.state_dict()``: parameters and float buffers as fp32, tied aliases included), loadable with
  ``torch.load(path, weights_only=True)`` and a strict ``load_state_dict`` into the single-process model.

Both run in one process with no process group. A path that is not a checkpoint, or a damaged one, ends
with one ``error: ...`` line and exit status 2.
"""

from __future__ import annotations

import json
from pathlib import Path

import click

from hybrid.errors import CheckpointError


def _size(n: int) -> str:
    for unit, scale in (("GB", 10**9), ("MB", 10**6), ("kB", 10**3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


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
def inspect_command(run_dir: Path, as_json: bool) -> None:
    """List the checkpoints of RUN_DIR: status, step, world layout, size on disk."""
    from hybrid.checkpoint import describe

    info = describe(run_dir)
    if as_json:
        click.echo(json.dumps(info))
        return
    rows = [["NAME", "STEP", "STATUS", "LAYOUT", "SIZE"]]
    for row in info["checkpoints"]:
        rows.append([row["name"], str(row["step"]), row["status"], _layout_text(row.get("world")),
                     _size(row["bytes"])])
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    click.echo(f"{info['run_dir']}: {len(info['checkpoints'])} checkpoint director"
               f"{'y' if len(info['checkpoints']) == 1 else 'ies'}")
    for r in rows:
        click.echo("  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip())
    latest = info["latest"]
    click.echo(f"resume uses: {latest}" if latest else "resume uses: nothing (no complete checkpoint)")


@checkpoint_group.command("consolidate")
@click.argument("path", type=click.Path(path_type=Path))
@click.option("--out", "out", type=click.Path(path_type=Path, dir_okay=False), required=True,
              help="Where to write the single-process state dict (torch.save format).")
def consolidate_command(path: Path, out: Path) -> None:
    """Write the single-process state dict (fp32 params, buffers, tied aliases) of PATH's latest (or the given) checkpoint to --out."""
    import torch

    from hybrid.checkpoint import consolidate

    state, ckpt, doc = consolidate(path)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_name(out.name + ".tmp")
        torch.save(state, tmp)
        tmp.replace(out)
    except OSError as exc:
        raise CheckpointError(f"cannot write --out {out}: {exc.strerror}; choose a writable path.") from None
    params = sum(t.numel() for t in state.values())
    click.echo(f"wrote {out}: {len(state)} tensors, {params:,} parameters (fp32) from {ckpt} "
               f"(step {doc['step']}, saved at {_layout_text(doc['world'])})")
