"""Damaged checkpoints, in one process: every file of a checkpoint bit-flipped, truncated or deleted in
turn. ``hybrid checkpoint inspect`` names the file, the ranks' choice of a checkpoint (``agreement.choose``
on a one-rank world, where its collectives are no-ops) falls back to the previous good one, and
``hybrid checkpoint consolidate`` refuses in one ``error:`` line, exit 2. Also: format-2 checkpoints (no
checksums), a non-finite weight, an unwritable ``--out``, and who verifies which file."""

from __future__ import annotations

import logging
import shutil
import sys
from pathlib import Path

import pytest
import torch

from hybrid.checkpoint import agreement, integrity, layout
from hybrid.comm.collectives import Comm
from hybrid.errors import CheckpointError
from launch.cli import main
from tests.unit import test_checkpoint_offline as offline
from tests.unit.test_checkpoint_offline import _write_checkpoint

GOOD, NEWEST = 5, 7


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> Path:
    """A run with two good checkpoints; each test damages a copy of the newest."""
    run = tmp_path_factory.mktemp("pristine")
    _write_checkpoint(run, GOOD)
    _write_checkpoint(run, NEWEST)
    return run


def _files(run: Path) -> list:
    return sorted(p.name for p in layout.final_dir(run, NEWEST).iterdir())


def _flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01  # one bit of one byte
    path.write_bytes(bytes(data))


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _status(run: Path, capsys) -> tuple:
    """(status of the newest checkpoint, the "resume uses" line) from ``hybrid checkpoint inspect``."""
    assert main(["checkpoint", "inspect", str(run)]) == 0
    lines = capsys.readouterr().out.splitlines()
    row = next(line for line in lines if line.startswith(layout.step_name(NEWEST)))
    return row, lines[-1]


def _refused(argv: list, capsys) -> str:
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith("error: ") and captured.err.count("\n") == 1, captured.err
    assert "Traceback" not in captured.err + captured.out
    return captured.err


def _chosen(run: Path, capsys=None) -> agreement.Choice:
    """The ranks' choice; with ``capsys``, also check that the first skip was logged (to stderr)."""
    logger = logging.getLogger(agreement.__name__)
    handler = logging.StreamHandler(sys.stderr)  # whatever pytest's logging plugin does with records
    logger.addHandler(handler)
    try:
        choice = agreement.choose(run, Comm(None), "cpu", fallback=True)
    finally:
        logger.removeHandler(handler)
    if capsys is not None:
        err = capsys.readouterr().err
        assert all(f"skipping checkpoint {p}" in err for p, _ in choice.skipped[:1]), err
    return choice


def test_the_pristine_run_verifies(pristine, capsys):
    row, uses = _status(pristine, capsys)
    assert row.split()[2] == "complete" and uses == f"resume uses: {layout.step_name(NEWEST)}"
    choice = _chosen(pristine)
    assert choice.path == layout.final_dir(pristine, NEWEST) and choice.skipped == []
    names = set(_files(pristine))
    assert {"COMPLETE", "hybrid.json", ".metadata"} < names and any(n.endswith(".distcp") for n in names)
    assert set(choice.inventory.files) == names - {"COMPLETE", "hybrid.json"}  # the DCP files


@pytest.mark.parametrize("damage", ["flip-middle", "flip-last", "truncate", "delete"])
def test_each_damaged_file_is_named_skipped_and_refused(pristine, tmp_path, capsys, damage):
    for name in _files(pristine):
        run = tmp_path / f"{damage}-{name}"
        shutil.copytree(pristine, run)
        path = layout.final_dir(run, NEWEST) / name
        size = path.stat().st_size
        if damage == "delete":
            path.unlink()
        elif damage == "truncate":
            _truncate(path)
        else:
            _flip(path, size // 2 if damage == "flip-middle" else size - 1)

        if damage == "delete" and name == layout.MARKER:
            expected = "incomplete (no marker)"  # unpublished, as a save that never finished
        elif damage == "delete":
            expected = f"missing: {name}"
        elif damage == "truncate" and name != layout.MARKER:
            expected = f"truncated: {name}"
        else:
            expected = f"corrupt: {name}"  # a halved marker no longer parses: it is corrupt, not short
        row, uses = _status(run, capsys)
        assert expected in row, (damage, name, row)
        assert uses == f"resume uses: {layout.step_name(GOOD)}"

        choice = _chosen(run, capsys)
        assert choice.path == layout.final_dir(run, GOOD), (damage, name)
        if expected.startswith(("missing", "truncated", "corrupt")):
            assert [(p.name, str(problem)) for p, problem in choice.skipped] == \
                [(layout.step_name(NEWEST), expected)]
        else:
            assert [(p.name, str(problem)) for p, problem in choice.skipped] == \
                [(layout.step_name(NEWEST), "missing: COMPLETE")]

        newest = layout.final_dir(run, NEWEST)
        err = _refused(["checkpoint", "consolidate", str(newest), "--out", str(tmp_path / "x.pt")], capsys)
        assert (expected if expected.startswith(("missing", "truncated", "corrupt")) else "incomplete") in err
        assert str(newest) in err
        assert not (tmp_path / "x.pt").exists() and not (tmp_path / "x.pt.tmp").exists()
        # the run: the checkpoint the resume uses (the older good one), named
        assert main(["checkpoint", "consolidate", str(run), "--out", str(tmp_path / "x.pt")]) == 0
        assert f"from {layout.final_dir(run, GOOD)} " in capsys.readouterr().out
        (tmp_path / "x.pt").unlink()


def test_no_good_checkpoint_is_refused_not_overwritten(pristine, tmp_path, capsys):
    """Checkpoints all damaged: a fresh start would overwrite and prune them, so the resume refuses in one
    sentence naming the directory and the fix (only interrupted saves there: a fresh start)."""
    run = tmp_path / "run"
    shutil.copytree(pristine, run)
    for step in (GOOD, NEWEST):
        data = next(layout.final_dir(run, step).glob("*.distcp"))
        _flip(data, 10)
    with pytest.raises(CheckpointError) as refused:
        _chosen(run)
    message = str(refused.value)
    assert f"no good checkpoint in {layout.checkpoints_dir(run)} (step-000007 (corrupt: __" in message
    assert "move" in message and "aside" in message and "\n" not in message
    _, uses = _status(run, capsys)
    assert uses.startswith("resume stops: no good checkpoint (2 damaged), and starting fresh would overwrite them")
    with pytest.raises(integrity.CheckpointDamaged, match="corrupt: __"):
        agreement.choose(run, Comm(None), "cpu", fallback=False)  # load() of a run directory: no fallback


def test_format_2_checkpoints_are_unverified_but_sizes_are_checked(tmp_path, capsys):
    _write_checkpoint(tmp_path, NEWEST, legacy=True)
    row, uses = _status(tmp_path, capsys)
    assert "complete (unverified" in row and uses == f"resume uses: {layout.step_name(NEWEST)}"
    assert _chosen(tmp_path, capsys).path == layout.final_dir(tmp_path, NEWEST)
    state, _, _ = offline.consolidate(tmp_path)
    assert torch.equal(state["w"], offline.FULL["w"])

    data = next(layout.final_dir(tmp_path, NEWEST).glob("*.distcp"))
    _truncate(data)
    row, uses = _status(tmp_path, capsys)
    assert f"truncated: {data.name}" in row and uses.startswith("resume stops: no good checkpoint (1 damaged)")
    _refused(["checkpoint", "consolidate", str(tmp_path), "--out", str(tmp_path / "x.pt")], capsys)


def test_sizes_only_inspection_reads_no_data(pristine, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(pristine, run)
    data = next(layout.final_dir(run, NEWEST).glob("*.distcp"))
    _flip(data, 3)
    assert main(["checkpoint", "inspect", str(run), "--sizes-only"]) == 0
    assert "complete (sizes checked, checksums not read)" in capsys.readouterr().out
    row, _ = _status(run, capsys)
    assert f"corrupt: {data.name}" in row


def test_a_non_finite_weight_is_not_consolidated(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(offline.FULL, "b", torch.tensor([0.5, float("nan"), 2.0]))
    _write_checkpoint(tmp_path, NEWEST)  # intact files (the checksums match), but a NaN in a weight
    err = _refused(["checkpoint", "consolidate", str(tmp_path), "--out", str(tmp_path / "x.pt")], capsys)
    assert "non-finite values (NaN or inf) in 'b'" in err
    assert not (tmp_path / "x.pt").exists() and not (tmp_path / "x.pt.tmp").exists()


def test_an_unwritable_out_is_one_sentence(pristine, tmp_path, capsys):
    (tmp_path / "a-file").write_text("x")
    under_a_file = tmp_path / "a-file" / "x.pt"
    for out in ("/proc/x.pt", "/proc/nope/x.pt", str(under_a_file)):
        err = _refused(["checkpoint", "consolidate", str(pristine), "--out", out], capsys)
        assert f"cannot write --out {out}" in err
    assert "a parent is not a directory" in err


def test_the_seal_tells_marker_from_manifest(pristine, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(pristine, run)
    ckpt = layout.final_dir(run, NEWEST)
    (ckpt / layout.MARKER).write_text(layout.step_name(NEWEST) + "\n")  # a format-2 marker on a format-3 one
    with pytest.raises(integrity.CheckpointDamaged, match="corrupt: COMPLETE"):
        integrity.inventory(ckpt)
    assert isinstance(integrity.CheckpointDamaged(ckpt, integrity.Problem("missing", "x"), "fix"), CheckpointError)


@pytest.mark.parametrize("legacy", [False, True])
def test_a_checkpoint_under_another_steps_name_is_misplaced(tmp_path, capsys, legacy):
    """Step GOOD's directory copied over step NEWEST's (a user "restoring" by hand): intact files, but the
    seal names step GOOD, so resuming it would claim step NEWEST with step GOOD's counters."""
    run = tmp_path / "run"
    _write_checkpoint(run, GOOD, legacy=legacy)
    _write_checkpoint(run, NEWEST, legacy=legacy)
    newest = layout.final_dir(run, NEWEST)
    shutil.rmtree(newest)
    shutil.copytree(layout.final_dir(run, GOOD), newest)
    expected = "misplaced: COMPLETE names another step"
    row, uses = _status(run, capsys)
    assert expected in row and uses == f"resume uses: {layout.step_name(GOOD)}", row
    choice = _chosen(run, capsys)
    assert choice.path == layout.final_dir(run, GOOD)
    assert [(p.name, str(problem).split(" (")[0]) for p, problem in choice.skipped] == \
        [(layout.step_name(NEWEST), expected)]
    err = _refused(["checkpoint", "consolidate", str(newest), "--out", str(tmp_path / "x.pt")], capsys)
    assert expected in err and str(newest) in err


def test_a_manifest_of_another_step_behind_a_good_seal_is_misplaced(pristine, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(pristine, run)
    newest = layout.final_dir(run, NEWEST)
    shutil.copy(layout.final_dir(run, GOOD) / layout.MANIFEST, newest / layout.MANIFEST)
    (newest / layout.MARKER).write_text(integrity.seal_text(newest, newest.name))  # resealed by hand
    with pytest.raises(integrity.CheckpointDamaged, match="misplaced: hybrid.json"):
        integrity.inventory(newest)


def test_verification_is_spread_over_the_ranks_by_bytes():
    files = {name: integrity.Expected(size, 0) for name, size in
             (("a", 100), ("b", 60), ("c", 50), ("d", 10), ("e", 0))}
    owners = integrity.assign(files, 2)
    assert owners == {"a": 0, "b": 1, "c": 1, "d": 0, "e": 0}
    assert integrity.assign(files, 1) == dict.fromkeys(files, 0)
    assert set(integrity.assign(files, 8).values()) == {0, 1, 2, 3, 4}


@pytest.mark.parametrize("edit", ["del doc['world']", "doc['world'] = None", "del doc['world']['tp']",
                                  "del doc['optimizer_step_count']", "doc['params'] = []"])
def test_a_hand_edited_manifest_is_listed_as_damaged_not_a_crash(pristine, tmp_path, capsys, edit):
    import json

    run = tmp_path / "run"
    shutil.copytree(pristine, run)
    path = layout.final_dir(run, NEWEST) / "hybrid.json"
    doc = json.loads(path.read_text())
    exec(edit, {"doc": doc})
    path.write_text(json.dumps(doc))
    row, uses = _status(run, capsys)
    assert "hybrid.json" in row and uses == f"resume uses: {layout.step_name(GOOD)}"
    assert main(["checkpoint", "inspect", str(run), "--json"]) == 0
    capsys.readouterr()


def test_a_pointer_that_is_not_text_is_ignored(pristine, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(pristine, run)
    (layout.checkpoints_dir(run) / "latest").write_bytes(b"\xe8\x00\xff garbage")
    assert layout.read_pointer(run) is None
    assert _status(run, capsys)[1] == f"resume uses: {layout.step_name(NEWEST)}"


def test_directories_this_user_may_not_read(pristine, tmp_path, capsys, monkeypatch):
    """A step directory that cannot be searched counts as published (verifying it names the file it cannot
    read), never as an unfinished save a resume passes over; a ``checkpoints/`` that cannot be listed, or an
    I/O error, is one sentence from inspect and consolidate alike, never a write error on ``--out``."""
    import errno

    run = tmp_path / "run"
    shutil.copytree(pristine, run)
    locked_step, root = layout.final_dir(run, GOOD), layout.checkpoints_dir(run)
    real_is_file, real_iterdir = Path.is_file, Path.iterdir

    def is_file(path):
        if path.parent == locked_step:
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return real_is_file(path)

    monkeypatch.setattr(Path, "is_file", is_file)
    assert layout.is_complete(locked_step)
    assert [e.complete for e in layout.scan(run)] == [True, True]

    for failure in (PermissionError(errno.EACCES, "Permission denied", str(root)),
                    OSError(errno.EIO, "Input/output error", str(root))):
        def iterdir(path, failure=failure):
            if path == root:
                raise failure
            return real_iterdir(path)

        monkeypatch.setattr(Path, "iterdir", iterdir)
        out = tmp_path / "x.pt"
        for argv in (["checkpoint", "inspect", str(run)], ["checkpoint", "consolidate", str(run), "--out", str(out)]):
            err = _refused(argv, capsys)
            assert str(root) in err and "--out" not in err, err
            assert ("permission denied" in err.lower()) == isinstance(failure, PermissionError), err
        assert not out.exists()
