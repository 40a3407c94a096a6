"""Checkpoint directory protocol, manifest checks, consolidation and the ``hybrid checkpoint`` CLI, in one
process. The checkpoints here are written with the same DCP planner and publish step the engine path uses,
as a single writer owning every piece (the multi-rank paths are in tests/dist/test_checkpoint.py)."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter

from hybrid.checkpoint import consolidate, describe, integrity, latest, layout, manifest
from hybrid.checkpoint.agreement import record_checksums
from hybrid.checkpoint.flat_planner import FlatSavePlanner
from hybrid.comm.collectives import Comm
from hybrid.errors import CheckpointError, UsageError
from launch.cli import main

# A small "model" saved at TP 2. Trainable: w (sliced along dim 1), b (replicated). Frozen: f (bf16,
# sliced along dim 0). Buffer: count (int64, 0-dim). w is tied: its other name is w_tied.
FULL = {"w": torch.arange(24, dtype=torch.float32).view(4, 6), "b": torch.tensor([0.5, -1.5, 2.0]),
        "f": torch.tensor([[1.0, 2.0, 3.0], [-0.5, 0.25, 8.0]]), "count": torch.tensor(7)}
SPECS = {"b": {"shape": [3], "tp_dim": None}, "w": {"shape": [4, 3], "tp_dim": 1}}
FROZEN = {"f": {"shape": [1, 3], "tp_dim": 0}}
BUFFERS = {"count": {"shape": [], "tp_dim": None}}
ALIASES = {"w_tied": "w"}


def _local(name: str, spec: dict, tp_rank: int) -> torch.Tensor:
    dim = spec["tp_dim"]
    return FULL[name] if dim is None else FULL[name].chunk(2, dim=dim)[tp_rank].contiguous()


def _write_checkpoint(run_dir: Path, step: int, publish: bool = True, marker: bool = True,
                      legacy: bool = False) -> Path:
    """A checkpoint as ``sharded.save`` writes it (checksums, sealed marker); ``legacy``: as format 2 did."""
    state, pieces = {}, {}
    for tp_rank in range(2):
        for name, spec in SPECS.items():
            local = _local(name, spec, tp_rank)
            for kind in manifest.KINDS:
                key = manifest.tensor_key(kind, tp_rank, name)
                state[key] = (local + (0 if kind == "master" else 100)).contiguous().view(-1).clone()
                pieces[key] = (0, local.numel())
        state[manifest.tensor_key(manifest.FROZEN, tp_rank, "f")] = _local("f", FROZEN["f"], tp_rank).bfloat16()
        state[manifest.tensor_key(manifest.BUFFER, tp_rank, "count")] = FULL["count"].clone()
    tmp = layout.temporary_dir(run_dir, step)
    tmp.mkdir(parents=True)
    planner = FlatSavePlanner(pieces)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        metadata = dcp.save(state, storage_writer=FileSystemWriter(tmp), planner=planner, no_dist=True)
    doc = manifest.build(step=step, optimizer_step_count=step, global_step=step,
                         world={"world_size": 4, "dp": 2, "tp": 2, "stage": 2, "precision": "fp32"},
                         params=SPECS, frozen=FROZEN, buffers=BUFFERS, aliases=ALIASES,
                         model_config={"hidden": 6}, extra={"data_step": step})
    if legacy:
        doc["version"] = 2
    else:  # one writer: the world's collective is a no-op
        doc["files"] = record_checksums(tmp, metadata, planner.final_plan.items, Comm(None), "cpu")
    manifest.write(tmp, doc)
    if not publish:
        return tmp
    final = layout.final_dir(run_dir, step)
    if marker:
        layout.publish(tmp, final, None if legacy else integrity.seal_text(tmp, final.name))
    else:
        tmp.rename(final)
    return final


def test_interrupted_checkpoints_are_skipped_and_pruned(tmp_path):
    good = _write_checkpoint(tmp_path, 10)
    _write_checkpoint(tmp_path, 20, marker=False)       # renamed but never marked complete
    stale = _write_checkpoint(tmp_path, 30, publish=False)  # a save that died mid-write
    assert latest(tmp_path) == good
    assert layout.read_pointer(tmp_path) == "step-000010"
    statuses = {row["name"]: row["status"] for row in describe(tmp_path)["checkpoints"]}
    assert statuses == {"step-000010": "complete", "step-000020": "incomplete (no marker)",
                        ".tmp-step-000030": "writing or interrupted"}

    newer = _write_checkpoint(tmp_path, 40)
    removed = layout.prune(tmp_path, keep_last=1, keep=newer)
    assert set(removed) == {good, stale}
    assert latest(tmp_path) == newer and layout.read_pointer(tmp_path) == "step-000040"
    assert (tmp_path / "checkpoints" / "step-000020").is_dir()  # left for a human to look at

    again = _write_checkpoint(tmp_path, 40)  # the same step published twice replaces the first
    assert again == newer and layout.is_complete(again)


def test_inspect_says_the_resume_stops_when_every_checkpoint_is_damaged(tmp_path):
    _write_checkpoint(tmp_path, 30, publish=False)  # interrupted only: a resume starts fresh
    doc = describe(tmp_path)
    assert doc["latest"] is None and doc["resume_stops"] is None
    damaged = _write_checkpoint(tmp_path, 10)
    data = next(damaged.glob("*.distcp"))
    data.write_bytes(data.read_bytes()[:10])  # truncated: the only complete checkpoint is bad
    doc = describe(tmp_path)  # as agreement.choose decides: stop rather than overwrite it
    assert doc["latest"] is None and doc["resume_stops"].startswith("no good checkpoint (1 damaged)")
    unmarked = tmp_path / "unmarked"
    _write_checkpoint(unmarked, 20, marker=False)  # published, never marked: choose() refuses it too
    assert describe(unmarked)["resume_stops"].startswith("no good checkpoint (1 damaged)")


def test_a_sealed_but_unrenamed_checkpoint_is_what_inspect_and_resume_use(tmp_path):
    _write_checkpoint(tmp_path, 10)
    sealed = _write_checkpoint(tmp_path, 20, publish=False)  # the crash came after the marker, before the rename
    (sealed / layout.MARKER).write_text(integrity.seal_text(sealed, layout.final_dir(tmp_path, 20).name))
    doc = describe(tmp_path)
    assert doc["latest"] == ".tmp-step-000020"
    row = {r["name"]: r["status"] for r in doc["checkpoints"]}[".tmp-step-000020"]
    assert row == "complete, sealed but not renamed (a crash before publishing)"


def test_a_checkpoint_of_another_model_config_is_refused():
    saved = {"model_config": {"model": {"hidden": 6, "n_heads": 4}, "train": {"lr": 1e-3}}}
    manifest.check_same_model_config(saved, {"model": {"hidden": 6, "n_heads": 4}, "train": {"lr": 5e-4}}, Path("c"))
    manifest.check_same_model_config(saved, None, Path("c"))  # nothing to compare: an engine loaded by hand
    with pytest.raises(CheckpointError, match=r"^c is a checkpoint of another model: model\.n_heads is 2 here but "
                                              r"was 4; resume with the model config it was trained with"):
        manifest.check_same_model_config(saved, {"model": {"hidden": 6, "n_heads": 2}}, Path("c"))


def test_consolidate_merges_tp_slices(tmp_path):
    _write_checkpoint(tmp_path, 5)
    state, ckpt, doc = consolidate(tmp_path)
    assert ckpt.name == "step-000005" and doc["extra"] == {"data_step": 5}
    assert set(state) == {"w", "b", "f", "count", "w_tied"}
    for name in FULL:
        assert torch.equal(state[name], FULL[name])
    assert state["f"].dtype == torch.float32 and state["count"].dtype == torch.int64
    assert state["w_tied"] is state["w"]


def test_resolve_and_manifest_errors_are_one_sentence(tmp_path):
    (tmp_path / "file.txt").write_text("hello")
    cases = [tmp_path / "missing", tmp_path / "file.txt", tmp_path]
    (tmp_path / "empty_run" / "checkpoints").mkdir(parents=True)
    cases.append(tmp_path / "empty_run")
    cases.append(_write_checkpoint(tmp_path / "run", 3, marker=False))
    for path in cases:
        with pytest.raises(CheckpointError) as err:
            layout.resolve(path)
        message = str(err.value)
        assert str(path) in message and message.count(". ") == 0 and "\n" not in message

    good = _write_checkpoint(tmp_path / "run", 4)
    (good / layout.MANIFEST).write_text("{not json")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        manifest.read(good)
    (good / layout.MANIFEST).write_text(json.dumps({"format": "something-else"}))
    with pytest.raises(CheckpointError, match="not a hybrid checkpoint"):
        manifest.read(good)


def test_another_model_or_tp_is_refused():
    doc = manifest.build(step=1, optimizer_step_count=1, global_step=1,
                         world={"world_size": 2, "dp": 1, "tp": 2, "stage": 0, "precision": "fp32"}, params=SPECS)
    where = Path("/runs/x/checkpoints/step-000001")
    manifest.check_same_model(doc, SPECS, 2, where)
    wider = {**SPECS, "w": {"shape": [4, 4], "tp_dim": 1}}
    renamed = {"b": SPECS["b"], "w2": SPECS["w"]}
    for params, tp, pattern in [(wider, 2, r"'w' has shape \[4, 6\] there but \[4, 8\] here"),
                                (renamed, 2, "another model: parameter 'w"),
                                (SPECS, 1, "tp=2 but this job runs tp=1")]:
        with pytest.raises(CheckpointError, match=pattern):
            manifest.check_same_model(doc, params, tp, where)

    doc = manifest.build(step=1, optimizer_step_count=1, global_step=1, params=SPECS, frozen=FROZEN,
                         buffers=BUFFERS, world={"world_size": 2, "dp": 1, "tp": 2, "stage": 0, "precision": "fp32"})
    manifest.check_same_model(doc, SPECS, 2, where, frozen=FROZEN, buffers=BUFFERS)
    thawed = {**SPECS, "f": FROZEN["f"]}
    for args, pattern in [((SPECS, 2, where), "another model: buffer 'count' differs"),
                          ((thawed, 2, where, None, BUFFERS),
                           "holds 'f' as a frozen parameter but this model has it as a parameter"),
                          ((SPECS, 2, where, FROZEN, {"count": {"shape": [2], "tp_dim": None}}),
                           r"buffer 'count' has shape \[\] there but \[2\] here")]:
        with pytest.raises(CheckpointError, match=pattern):
            manifest.check_same_model(doc, *args)
    with pytest.raises(ValueError, match="JSON-serializable"):  # a model config JSON cannot hold
        manifest.build(step=1, optimizer_step_count=1, global_step=1, world={}, params={},
                       model_config={"x": object()})
    with pytest.raises(UsageError, match=r"client_state\['x'\] is of type object"):
        manifest.build(step=1, optimizer_step_count=1, global_step=1, world={}, params={}, extra={"x": object()})


def test_cli_inspect_and_consolidate(tmp_path, capsys):
    _write_checkpoint(tmp_path, 7)
    _write_checkpoint(tmp_path, 8, publish=False)
    assert main(["checkpoint", "inspect", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "step-000007" in out and "complete" in out and "dp 2 × tp 2, stage 2, fp32" in out
    assert ".tmp-step-000008" in out and "resume uses: step-000007" in out
    assert main(["checkpoint", "inspect", str(tmp_path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["latest"] == "step-000007"

    out_file = tmp_path / "model.pt"
    assert main(["checkpoint", "consolidate", str(tmp_path), "--out", str(out_file)]) == 0
    assert "step 7" in capsys.readouterr().out
    loaded = torch.load(out_file, weights_only=True)
    assert set(loaded) == set(FULL) | set(ALIASES) and all(torch.equal(loaded[k], FULL[k]) for k in FULL)
    safe = tmp_path / "model.safetensors"  # the format follows the suffix; tied aliases are left out
    assert main(["checkpoint", "consolidate", str(tmp_path), "--out", str(safe)]) == 0
    capsys.readouterr()
    from safetensors.torch import load_file
    loaded = load_file(str(safe))
    assert set(loaded) == set(FULL) and all(torch.equal(loaded[k], FULL[k]) for k in FULL)

    for argv in (["checkpoint", "consolidate", str(tmp_path / "nope"), "--out", str(out_file)],
                 ["checkpoint", "inspect", str(tmp_path / "checkpoints" / ".tmp-step-000008" / "x")]):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and err.count("\n") == 1
