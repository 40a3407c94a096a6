"""A directory link that loops back inside job.working_dir, or a file Ray cannot pack (a named pipe, a socket), is
one sentence before Ray packs anything (Ray's packing walk follows directory symlinks: `ln -s . current` plus
`sub/up -> ..` made the launch spin forever; it reads every file, and a pipe blocked the launch forever),
while links Ray's walk never enters or that lead elsewhere ship as before. Pure filesystem tests: no Ray
cluster is started (Ray's packaging helpers are imported, which works offline)."""

import builtins
import io
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from hybrid.errors import ConfigError
from launch.ray.working_dir_check import check_working_dir
from launch.ray.runtime_env import (ALWAYS_EXCLUDED, client_runtime_env, runtime_env, ship,
                                working_dir_excludes)
from launch.spec import parse_spec


def _tree(root: Path) -> Path:
    """A small code directory: a module, a package, a data file."""
    (root / "pkg").mkdir(parents=True)
    (root / "train.py").write_text("def train(ctx):\n    return 1\n")
    (root / "pkg" / "__init__.py").write_text("")
    (root / "pkg" / "data.txt").write_text("x" * 100)
    return root


def _check(root: Path, excludes=ALWAYS_EXCLUDED):
    check_working_dir(str(root), list(excludes))


def _refused(root: Path, link: str, excludes=ALWAYS_EXCLUDED) -> str:
    with pytest.raises(ConfigError) as err:
        _check(root, excludes)
    message = str(err.value)
    assert message.startswith(f"job.working_dir {root} cannot be shipped to the ranks: its directory link {link} (")
    assert message.endswith(f"remove the link, add {link} to .gitignore, or point job.working_dir at the "
                            "code's directory.")
    assert message.count(". ") == 0  # one sentence
    return message


def test_a_link_to_its_own_directory_or_to_a_parent_is_refused_naming_the_link(tmp_path):
    w = _tree(tmp_path / "w")
    os.symlink(".", w / "current")
    assert "(-> .)" in _refused(w, "current")
    os.remove(w / "current")

    (w / "sub").mkdir()
    os.symlink("..", w / "sub" / "up")
    assert "(-> ..)" in _refused(w, "sub/up")

    os.symlink(".", w / "loop")  # the probe's case: both at once (the first in name order is named)
    _refused(w, "loop")


def test_a_loop_through_several_links_or_outside_the_working_dir_names_the_link_that_closes_it(tmp_path):
    w = _tree(tmp_path / "w")
    (w / "p").mkdir()
    (w / "r").mkdir()
    os.symlink("../r", w / "p" / "q")  # p/q -> r, r/s -> p: neither alone points at its own parent
    os.symlink("../p", w / "r" / "s")
    assert "(that is r/s -> ../p) leads back" in _refused(w, "p/q/s")  # where the link file itself is

    w2 = _tree(tmp_path / "w2")
    outside = tmp_path / "outside"
    outside.mkdir()
    os.symlink(w2, outside / "back")  # w2/ext -> outside, outside/back -> w2
    os.symlink(outside, w2 / "ext")
    assert f"(that is {outside / 'back'} -> {w2}) leads back" in _refused(w2, "ext/back")


def test_a_link_to_a_directory_that_contains_the_working_dir_is_refused_without_walking_it(tmp_path, monkeypatch):
    w = _tree(tmp_path / "deep" / "w")
    (w / "sub").mkdir()
    os.symlink("/", w / "sub" / "root")
    listed = []
    real_scandir = os.scandir
    monkeypatch.setattr(os, "scandir", lambda path: listed.append(str(path)) or real_scandir(path))
    _refused(w, "sub/root")
    assert len(listed) < 10  # refused at the link, never a walk of the whole filesystem
    monkeypatch.undo()
    os.remove(w / "sub" / "root")
    os.symlink(tmp_path, w / "sub" / "grandparent")
    _refused(w, "sub/grandparent")


def test_links_that_do_not_loop_ship_as_before(tmp_path):
    w = _tree(tmp_path / "w")
    shared = tmp_path / "shared"
    (shared / "inner").mkdir(parents=True)
    (shared / "inner" / "f.txt").write_text("f")
    os.symlink(shared, w / "shared")  # a directory outside
    os.symlink("pkg", w / "pkg_alias")  # a sibling directory (a venv's lib64 -> lib)
    (w / "a" / "b").mkdir(parents=True)
    os.symlink(shared / "inner", w / "pkg" / "..__")  # a name, not a parent
    os.symlink("../../pkg", w / "a" / "b" / "cousin")  # a cousin, reached twice
    os.symlink("train.py", w / "entry.py")  # a file
    os.symlink("nowhere", w / "dangling")  # a link to nothing
    os.symlink("self", w / "self")  # a link to itself (ELOOP): no directory
    os.symlink(w / "pkg" / "data.txt", w / "a" / "data.txt")
    _check(w)


def test_a_loop_the_walk_never_enters_is_not_refused(tmp_path):
    w = _tree(tmp_path / "w")
    for excluded in (".venv/lib", "venv/x", ".git/modules", "node_modules/pkg", "runs/a/ckpt", "logs/old"):
        (w / excluded).mkdir(parents=True)
        os.symlink("..", w / excluded / "up")  # a loop inside each: none of them is looked into
        os.symlink(".", w / excluded / "here")
    (w / ".gitignore").write_text("node_modules/\n# comment\n")
    (w / "runs" / ".rayignore").write_text("a\n")
    (w / "logs" / ".gitignore").write_text("*\n!.gitignore\n")
    excludes = list(ALWAYS_EXCLUDED) + ["/runs/a/"]
    _check(w, excludes)

    os.symlink(".", w / "current")  # the link itself ignored, by name or as a directory (its contents)
    (w / ".gitignore").write_text("node_modules/\ncurrent\n")
    _check(w, excludes)
    (w / ".gitignore").write_text("node_modules/\ncurrent/\n")
    _check(w, excludes)
    (w / ".gitignore").write_text("node_modules/\n")
    _refused(w, "current", excludes)


def test_gitignore_counts_only_when_ray_reads_it(tmp_path):
    w = _tree(tmp_path / "w")
    os.symlink(".", w / "current")
    (w / ".gitignore").write_text("current\n")
    _check(w)
    with pytest.raises(ConfigError, match="directory link current "):
        check_working_dir(str(w), list(ALWAYS_EXCLUDED), include_gitignore=False)
    (w / ".rayignore").write_text("current\n")  # .rayignore always counts
    check_working_dir(str(w), list(ALWAYS_EXCLUDED), include_gitignore=False)


def test_a_working_dir_that_is_itself_a_link_and_missing_or_unreadable_ones_are_left_to_ray(tmp_path):
    w = _tree(tmp_path / "w")
    os.symlink(w, tmp_path / "current")
    _check(tmp_path / "current")
    os.symlink(".", w / "again")
    _refused(tmp_path / "current", "again")
    _check(tmp_path / "nowhere")  # Ray's own error says that one
    _check(w / "train.py")
    if os.geteuid() != 0:
        locked = tmp_path / "locked"
        locked.mkdir()
        os.symlink("..", locked / "up")
        locked.chmod(0)
        try:
            _check(tmp_path / "locked")
        finally:
            locked.chmod(0o755)


def test_the_check_reads_no_file_contents(tmp_path, monkeypatch):
    w = _tree(tmp_path / "w")
    (w / ".gitignore").write_text("*.bin\n")
    (w / "pkg" / "big.bin").write_bytes(b"\0" * 1000)
    opened = []
    for owner in (io, builtins):
        monkeypatch.setattr(owner, "open", lambda file, *a, _open=io.open, **k: opened.append(str(file)) or
                            _open(file, *a, **k))
    _check(w)
    assert opened and all(Path(p).name in (".gitignore", ".rayignore") for p in opened)


def _spec(tmp_path, address="local"):
    (tmp_path / "model.yaml").write_text("model: {vocab_size: 256, seq_len: 8, n_layers: 1, hidden: 16, n_heads: 2}\n")
    return parse_spec({"cluster": {"address": address, "nodes": 1, "gpus_per_node": 1, "gpu_memory_gb": 1},
                       "job": {"entrypoint": "hybrid.models.gpt:train", "config": "model.yaml", "steps": 1,
                               "checkpoint": {"dir": "runs/x"}}},
                      base_dir=tmp_path, path=tmp_path / "mine.yaml")


def test_ship_and_ray_client_refuse_a_loop_before_ray_packs_anything(tmp_path, monkeypatch):
    from ray._private.runtime_env import working_dir

    def never(*args, **kwargs):
        raise AssertionError("Ray was asked to pack a looping directory")

    monkeypatch.setattr(working_dir, "upload_working_dir_if_needed", never)
    spec = _spec(tmp_path)
    (tmp_path / "sub").mkdir()
    os.symlink("..", tmp_path / "sub" / "up")
    with pytest.raises(ConfigError, match=r"^job.working_dir .* its directory link sub/up \(-> \.\.\) "):
        ship(runtime_env(spec))
    assert client_runtime_env(spec)["working_dir"] == str(tmp_path)  # not ray://: ship checks it later
    with pytest.raises(ConfigError, match=r"its directory link sub/up "):
        client_runtime_env(_spec(tmp_path, address="ray://127.0.0.1:10001"))

    os.remove(tmp_path / "sub" / "up")
    (tmp_path / "runs" / "x").mkdir(parents=True)
    os.symlink("..", tmp_path / "runs" / "x" / "up")  # inside the excluded checkpoint directory: fine
    assert "/runs/x/" in working_dir_excludes(spec)
    assert client_runtime_env(_spec(tmp_path, address="ray://127.0.0.1:10001"))["working_dir"] == str(tmp_path)
    monkeypatch.setattr(working_dir, "upload_working_dir_if_needed",
                        lambda env, **kwargs: {**env, "working_dir": "gcs://x"})
    assert ship(runtime_env(spec))["working_dir"] == "gcs://x"


def test_what_passes_the_check_rays_own_packing_walk_finishes(tmp_path):
    """The excluded loops above, hashed by Ray's own walk in a subprocess (a loop would hang it)."""
    w = _tree(tmp_path / "w")
    for excluded in (".venv/lib", "node_modules/pkg", "runs/a/ckpt"):
        (w / excluded).mkdir(parents=True)
        os.symlink("..", w / excluded / "up")
        os.symlink(".", w / excluded / "here")
    os.symlink(".", w / "current")
    os.symlink("pkg", w / "pkg_alias")
    (w / ".gitignore").write_text("node_modules/\ncurrent/\n")
    excludes = list(ALWAYS_EXCLUDED) + ["/runs/a/"]
    _check(w, excludes)
    script = textwrap.dedent(f"""
        from ray._private.runtime_env.packaging import get_uri_for_directory
        print(get_uri_for_directory({str(w)!r}, include_gitignore=True, excludes={excludes!r}))
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.startswith("gcs://_ray_pkg_"), done.stderr


def test_ray_logs_kept_by_earlier_launches_are_not_shipped(tmp_path):
    """Runs whose run directories sit in the working directory (the bench's, a user's runs/ beside the cluster
    file) kept their Ray session logs there; shipped to the next launch they made every TP-2 rank die at
    start-up. Ray's own packing gives the same package with or without them."""
    w = _tree(tmp_path / "w")
    script = textwrap.dedent(f"""
        from ray._private.runtime_env.packaging import get_uri_for_directory
        print(get_uri_for_directory({str(w)!r}, include_gitignore=True, excludes={list(ALWAYS_EXCLUDED)!r}))
    """)

    def package() -> str:
        done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        return done.stdout.strip()

    kept_dirs = ("runs/old/ray-logs", "runs/old/ray-logs.previous", "ray-logs")
    for kept in kept_dirs:
        (w / kept / "events").mkdir(parents=True)  # Ray hashes the names of directories it skips the files of
    clean = package()
    for kept in kept_dirs:
        (w / kept / "worker-1.err").write_text("a worker's log\n")
        (w / kept / "events" / "event_RAYLET.log").write_text("{}\n")
    assert package() == clean
    (w / "runs" / "old" / "metrics.jsonl").write_text("{}\n")  # the rest of a run directory still ships
    assert package() != clean


def _special_refused(root: Path, shown: str, what: str) -> None:
    with pytest.raises(ConfigError) as err:
        _check(root)
    assert str(err.value).startswith(f"job.working_dir {root} cannot be shipped to the ranks: {shown} is {what}, ")
    assert str(err.value).count("\n") == 0


def test_a_pipe_socket_or_link_to_one_is_refused_unless_nothing_ships_it(tmp_path):
    import socket

    w = _tree(tmp_path / "w")
    os.mkfifo(w / "pkg" / "pipe")
    _special_refused(w, "pkg/pipe", "a named pipe")
    (w / ".gitignore").write_text("pipe\n")  # ignored: Ray's walk never reads it
    _check(w)
    (w / "pkg" / "pipe").unlink()
    os.mkfifo(tmp_path / "elsewhere")
    (w / "feed").symlink_to(tmp_path / "elsewhere")  # the zip reads through the link
    _special_refused(w, "feed", "a named pipe")
    (w / "feed").unlink()
    (w / ".venv").mkdir()
    os.mkfifo(w / ".venv" / "pipe")  # in an excluded directory
    (w / "dangling").symlink_to(tmp_path / "nothing")  # left to Ray's own error, as before
    _check(w)
    server = socket.socket(socket.AF_UNIX)
    try:
        server.bind(str(w / "pkg" / "sock"))
        _special_refused(w, "pkg/sock", "a socket")
    finally:
        server.close()


def test_ship_refuses_a_pipe_before_ray_reads_anything(tmp_path):
    w = _tree(tmp_path / "w")
    os.mkfifo(w / "pipe")
    with pytest.raises(ConfigError, match="pipe is a named pipe"):
        ship({"working_dir": str(w), "excludes": list(ALWAYS_EXCLUDED)})
