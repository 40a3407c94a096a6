"""The checkpoint directory's own rules, in one process: pruning counts only good checkpoints, one job per
directory (the lock), a directory laid out wrong, the informational pointer, moved or symlinked checkpoint
directories, an ``--out`` inside a checkpoint, unreadable files, and a save that cannot be written."""

from __future__ import annotations

import builtins
import errno
import io
import os
import shutil
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import torch

from hybrid.checkpoint import agreement, describe, integrity, layout, lock, offline, sharded
from hybrid.comm.collectives import Comm
from hybrid.errors import CheckpointError, ConfigError
from launch.cli import main
from tests.unit.test_checkpoint_integrity import _refused
from tests.unit.test_checkpoint_offline import FULL, _write_checkpoint

REPO = Path(__file__).resolve().parents[2]


def _fake(run: Path, step: int, *, temporary: bool = False, marker: bool = True) -> Path:
    """A directory that ``layout`` sees as a checkpoint (its marker only: layout reads no data)."""
    path = (layout.temporary_dir if temporary else layout.final_dir)(run, step)
    path.mkdir(parents=True)
    if marker:
        (path / layout.MARKER).write_text(path.name + "\n")
    return path


# -- pruning -------------------------------------------------------------------------------------------
def test_prune_keeps_the_newest_good_ones_and_never_counts_known_bad_ones(tmp_path):
    two, four, six = (_fake(tmp_path, s) for s in (2, 4, 6))
    eight = _fake(tmp_path, 8)                         # the save just made
    ten = _fake(tmp_path, 10)                          # newer, skipped by the resume: not good
    interrupted = _fake(tmp_path, 12, temporary=True, marker=False)
    bad = {four}
    removed = layout.prune(tmp_path, keep_last=2, keep=eight, good=lambda p: p not in bad)
    assert set(removed) == {two, four, interrupted}    # kept: 8 and 6 (the newest good); 4 is older: removed
    assert all(p.is_dir() for p in (six, eight, ten))


def test_prune_counts_and_keeps_a_sealed_temporary(tmp_path):
    two = _fake(tmp_path, 2)
    sealed = _fake(tmp_path, 4, temporary=True)        # marker written, crash before the rename: resume loads it
    six = _fake(tmp_path, 6)
    assert layout.prune(tmp_path, keep_last=2, keep=six) == [two]
    assert sealed.is_dir()
    assert layout.prune(tmp_path, keep_last=1, keep=six) == [sealed]


def test_prune_removes_the_earlier_copy_of_a_re_saved_step_once_the_new_one_is_in_place(tmp_path):
    """A crash inside publish, between moving step N aside and renaming the new save into place, leaves
    .tmp-old-step-N beside the sealed .tmp-step-N; nothing loads it, and scan does not list it."""
    sealed = _fake(tmp_path, 4, temporary=True)
    old = layout.checkpoints_dir(tmp_path) / ".tmp-old-step-000004"
    old.mkdir()
    (old / layout.MARKER).write_text("step-000004\n")
    orphan = layout.checkpoints_dir(tmp_path) / ".tmp-old-step-000002"  # no new save of step 2: left alone
    orphan.mkdir()
    assert layout.prune(tmp_path, keep_last=None) == [old]
    assert sealed.is_dir() and orphan.is_dir() and not old.exists()


def test_a_misplaced_copy_does_not_look_intact(tmp_path):
    good = _write_checkpoint(tmp_path, 6)
    shutil.copytree(good, layout.final_dir(tmp_path, 10))  # "step-10" holding step 6
    assert integrity.looks_intact(good)
    assert not integrity.looks_intact(layout.final_dir(tmp_path, 10))
    truncated = _write_checkpoint(tmp_path, 8)
    data = next(truncated.glob("*.distcp"))
    data.write_bytes(data.read_bytes()[:10])
    assert not integrity.looks_intact(truncated)


# -- one job per directory --------------------------------------------------------------------------------
def _other_process(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=REPO, capture_output=True, text=True,
                          timeout=60)


def test_a_second_job_is_refused_while_the_first_holds_the_lock(tmp_path):
    path = lock.acquire(tmp_path)
    assert lock.acquire(tmp_path) == path              # re-entrant in one process
    lock.release(tmp_path)
    assert f"pid {os.getpid()}" in path.read_text()
    other = _other_process(f"""
        from hybrid.checkpoint import lock
        try:
            lock.acquire({str(tmp_path)!r}, wait_s=0.3)
        except lock.CheckpointLocked as exc:
            print(exc)
    """)
    message = other.stdout.strip()
    assert f"checkpoint directory {tmp_path / 'checkpoints'} is in use by another job (pid {os.getpid()} on" \
           in message, other.stderr
    assert "\n" not in message and "job.checkpoint.dir" in message
    lock.release(tmp_path)                             # the last release unlocks
    assert _other_process(f"""
        from hybrid.checkpoint import lock
        lock.acquire({str(tmp_path)!r}, wait_s=0)
    """).returncode == 0


def _holder(run_dir: Path, **env: str) -> subprocess.Popen:
    """Another process that takes the directory's lock, says "held" and exits once its stdin is closed
    (``_exit_soon``): a predecessor whose exit the test times, not a sleep it must outlast."""
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import sys
        from hybrid.checkpoint import lock
        lock.acquire({str(run_dir)!r})
        print("held", flush=True)
        sys.stdin.read()
    """)], cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env={**os.environ, **env})
    assert holder.stdout.readline().strip() == "held"
    return holder


def _exit_soon(holder: subprocess.Popen, after_s: float = 0.6) -> threading.Timer:
    """Let ``holder`` exit ``after_s`` from now: the acquire the test makes next must wait for it, well past the
    0.2 s a refusal would take (a timer fires late, never early)."""
    timer = threading.Timer(after_s, holder.stdin.close)
    timer.start()
    return timer


def test_a_restarted_job_waits_for_its_predecessor_to_exit(tmp_path):
    holder = _holder(tmp_path)
    try:
        with pytest.raises(lock.CheckpointLocked):
            lock.acquire(tmp_path, wait_s=0.2)
        _exit_soon(holder)
        lock.acquire(tmp_path, wait_s=30)               # the holder exits: the OS drops its lock
        lock.release(tmp_path)
    finally:
        holder.kill()
        holder.wait()


def test_an_earlier_attempt_of_the_same_job_is_waited_for_longer_than_another_job(tmp_path, monkeypatch):
    holder = _holder(tmp_path, HYBRID_JOB_ID="job-a")
    monkeypatch.setattr(lock, "WAIT_S", 0.2)
    try:
        assert lock.holder(tmp_path).endswith(", job job-a")
        monkeypatch.setenv("HYBRID_JOB_ID", "job-b")
        with pytest.raises(lock.CheckpointLocked, match="in use by another job"):
            lock.acquire(tmp_path)                       # another job: refused after WAIT_S
        monkeypatch.setenv("HYBRID_JOB_ID", "job-a")
        _exit_soon(holder)
        lock.acquire(tmp_path)                           # its own earlier attempt: waited for (it exits)
        lock.release(tmp_path)
    finally:
        holder.kill()
        holder.wait()


def test_the_same_directory_spelt_two_ways_is_one_lock(tmp_path):
    lock.acquire(tmp_path)
    try:
        lock.acquire(tmp_path / "." / ".." / tmp_path.name, wait_s=0)  # re-entrant, not "another job"
        lock.release(tmp_path / ".." / tmp_path.name)
    finally:
        lock.release(tmp_path)
    assert not lock._held


def test_exclusive_on_a_one_rank_world(tmp_path):
    with agreement.exclusive(tmp_path, Comm(None), "cpu"):
        with agreement.exclusive(tmp_path, Comm(None), "cpu"):
            pass
        assert lock.lock_path(tmp_path).resolve() in lock._held
    assert lock.lock_path(tmp_path).resolve() not in lock._held


# -- a directory laid out wrong, the pointer ------------------------------------------------------------------
def test_checkpoints_as_a_file_or_latest_as_a_directory_is_refused_up_front(tmp_path):
    from launch.spec import _checkpoint  # the cluster file's job.checkpoint section

    def spec(run: Path):
        return _checkpoint({"dir": str(run)}, tmp_path, True)

    as_file, as_dir = tmp_path / "a", tmp_path / "b"
    as_file.mkdir()
    (as_file / "checkpoints").write_text("x")
    (as_dir / "checkpoints" / "latest").mkdir(parents=True)
    for run, what in ((as_file, "is a file, not a directory"), (as_dir, "latest is a directory")):
        assert what in layout.layout_problem(run)
        with pytest.raises(ConfigError, match=f"^job.checkpoint.dir .*{what}.*move it aside"):
            spec(run)
        with pytest.raises(CheckpointError, match=what):
            lock.acquire(run, wait_s=0)


def test_a_pointer_that_cannot_be_written_is_a_warning(tmp_path, caplog):
    _write_checkpoint(tmp_path, 4)
    pointer = layout.checkpoints_dir(tmp_path) / layout.POINTER
    pointer.unlink()
    pointer.mkdir()                                    # created after the job started
    six = _write_checkpoint(tmp_path, 6)               # published all the same
    assert layout.is_complete(six) and layout.latest(tmp_path) == six
    assert "could not update" in caplog.text
    assert not list(layout.checkpoints_dir(tmp_path).glob(".latest.tmp-*"))


def test_replacing_a_step_that_is_a_symlink_leaves_nothing_behind(tmp_path):
    elsewhere = _write_checkpoint(tmp_path / "other", 6)
    root = layout.checkpoints_dir(tmp_path)
    root.mkdir(parents=True)
    (root / "step-000006").symlink_to(elsewhere)
    _write_checkpoint(tmp_path, 6)
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step-000006"]
    assert elsewhere.is_dir() and layout.is_complete(elsewhere)  # the link's target is not touched


# -- consolidate / inspect: which checkpoint, under which name --------------------------------------------
def test_consolidate_uses_what_resume_uses_a_sealed_temporary(tmp_path, capsys):
    _write_checkpoint(tmp_path, 10)
    sealed = _write_checkpoint(tmp_path, 20, publish=False)
    (sealed / layout.MARKER).write_text(integrity.seal_text(sealed, layout.final_dir(tmp_path, 20).name))
    out = tmp_path / "x.pt"
    assert main(["checkpoint", "consolidate", str(tmp_path), "--out", str(out)]) == 0
    assert f"from {sealed} (step 20" in capsys.readouterr().out
    assert agreement.choose(tmp_path, Comm(None), "cpu", fallback=True).path == sealed


def test_a_moved_renamed_or_symlinked_checkpoint_is_accepted(tmp_path, capsys):
    original = _write_checkpoint(tmp_path / "run", 6)
    best = tmp_path / "best"
    shutil.copytree(original, best)
    link = tmp_path / "link"
    link.symlink_to(original)
    for path in (best, link):
        state, ckpt, doc = offline.consolidate(path)
        assert ckpt == path and doc["step"] == 6 and torch.equal(state["w"], FULL["w"])
        assert main(["checkpoint", "inspect", str(path)]) == 0
        out = capsys.readouterr().out
        assert f"{path.name}  6     complete" in out and f"resume uses: {path.name}" in out
    assert main(["checkpoint", "inspect", str(tmp_path / "run" / "checkpoints")]) == 0
    assert "resume uses: step-000006" in capsys.readouterr().out
    assert offline.consolidate(tmp_path / "run" / "checkpoints")[1] == original


def test_out_inside_a_checkpoint_is_refused(tmp_path, capsys):
    ckpt = _write_checkpoint(tmp_path, 6)
    data = next(ckpt.glob("*.distcp"))
    before = data.read_bytes()
    for out in (data, ckpt / "model.pt", layout.checkpoints_dir(tmp_path) / "model.pt"):
        err = _refused(["checkpoint", "consolidate", str(tmp_path), "--out", str(out)], capsys)
        assert f"--out {out} lies inside the checkpoint directory" in err
    assert data.read_bytes() == before and not (ckpt / "model.pt").exists()
    assert describe(tmp_path)["latest"] == ckpt.name


# -- a file that cannot be read ------------------------------------------------------------------------------
@pytest.fixture
def unreadable(monkeypatch):
    """``unreadable(path)``: opening that file raises PermissionError (we may run as root, where chmod 000
    changes nothing)."""
    paths = set()
    real_open = builtins.open

    def fake_open(file, *args, **kwargs):
        if str(file) in paths:
            raise PermissionError(errno.EACCES, "Permission denied", str(file))
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", fake_open)
    monkeypatch.setattr(io, "open", fake_open)  # pathlib's
    return lambda path: paths.add(str(path))


def test_an_unreadable_file_stops_the_resume_instead_of_skipping(tmp_path, capsys, unreadable):
    _write_checkpoint(tmp_path, 4)
    newest = _write_checkpoint(tmp_path, 6)
    data = next(newest.glob("*.distcp"))
    unreadable(data)
    row = {r["name"]: r["status"] for r in describe(tmp_path)["checkpoints"]}
    assert row["step-000006"] == f"unreadable: {data.name}"
    with pytest.raises(integrity.CheckpointUnreadable, match=f"cannot read {data} .*permissions"):
        agreement.choose(tmp_path, Comm(None), "cpu", fallback=True)
    assert main(["checkpoint", "inspect", str(tmp_path)]) == 0
    assert capsys.readouterr().out.splitlines()[-1].startswith(f"resume stops: cannot read {data}")
    err = _refused(["checkpoint", "consolidate", str(tmp_path), "--out", str(tmp_path / "x.pt")], capsys)
    assert f"cannot read {data}" in err

    unreadable(newest / layout.MARKER)
    with pytest.raises(integrity.CheckpointUnreadable, match="COMPLETE"):
        agreement.choose(tmp_path, Comm(None), "cpu", fallback=True)


# -- a save that cannot be written ---------------------------------------------------------------------------
def test_a_failed_write_is_one_sentence_naming_the_cause():
    import torch.distributed.checkpoint as dcp

    from hybrid.checkpoint.write_errors import write_failed

    full = OSError(errno.ENOSPC, "No space left on device")
    exc = dcp.api.CheckpointException("write", {1: (full, None), 0: (RuntimeError("peer\nmore"), None)})
    tmp = Path("/runs/a/checkpoints/.tmp-step-000008")
    assert sharded._cause(exc, tmp) == ("No space left on device on rank 1",
                                        "free space there (or lower job.checkpoint.keep_last)")
    err = write_failed(8, tmp, *sharded._cause(exc, tmp), previous=None)
    assert str(err) == ("saving the step-8 checkpoint into /runs/a/checkpoints failed (No space left on device on "
                        "rank 1; the partial .tmp-step-000008 was removed); free space there (or lower "
                        "job.checkpoint.keep_last) and run the job again to resume from step 0.")
    denied = dcp.api.CheckpointException("write", {0: (PermissionError(errno.EACCES, "Permission denied"), None)})
    assert sharded._cause(denied, tmp) == ("Permission denied on rank 0", "make it writable for every rank")  # by errno
    in_the_way = dcp.api.CheckpointException("write", {1: (NotADirectoryError(errno.ENOTDIR, "Not a directory"), None)})
    assert sharded._cause(in_the_way, tmp)[1].startswith("move aside the file that stands where a directory")


def test_a_checkpoint_of_another_optimizer_or_its_options_is_refused_by_name():
    from hybrid.checkpoint.manifest import check_same_optimizer

    adamw = {"optimizer": {"type": "AdamW", "state": ["exp_avg", "exp_avg_sq"]}}
    where = Path("run/checkpoints/step-000004")
    check_same_optimizer(adamw, {"type": "AdamW", "state": ["exp_avg", "exp_avg_sq"]}, where)  # lr etc. may change
    with pytest.raises(CheckpointError, match=r"^run/checkpoints/step-000004 was saved with optimizer AdamW but "
                                              r"this run uses RAdam; resume with optimizer.type: AdamW, or"):
        check_same_optimizer(adamw, {"type": "RAdam", "state": ["exp_avg", "exp_avg_sq"]}, where)  # same names
    with pytest.raises(CheckpointError, match=r"holding state exp_avg, exp_avg_sq but this run's AdamW holds "
                                              r"exp_avg, exp_avg_sq, max_exp_avg_sq \(an option such as amsgrad"):
        check_same_optimizer(adamw, {"type": "AdamW", "state": ["exp_avg", "exp_avg_sq", "max_exp_avg_sq"]}, where)


def test_extra_state_that_json_can_dump_but_not_sort_is_refused_before_any_rank_writes():
    """json.dumps took {1: .., "a": ..}; the manifest's sorted write then failed on rank 0 alone, after the
    data was written, and the other ranks waited for it until the collective timeout."""
    from hybrid.checkpoint import manifest

    from hybrid.errors import UsageError

    with pytest.raises(UsageError, match=r"client_state has the key 1 \(of type int\)"):
        manifest.build(step=1, optimizer_step_count=1, global_step=1, world={}, params={}, extra={1: "x", "a": "y"})
