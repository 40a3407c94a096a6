"""The NVMe swap store (hybrid.zero.nvme) on real files: its layout arithmetic, records read and written back
exactly through a few buffers, cleanup, and the disk's real errors -- a file-size limit (RLIMIT_FSIZE, in a
child process) at creation and in the middle of a sweep, a full disk (ENOSPC on a 1 MB tmpfs mounted in a user
namespace of its own, where the system allows one), a file cut short behind the store's back."""

from __future__ import annotations

import contextlib
import gc
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from hybrid.errors import JobError
from hybrid.plan.swap_layout import (ALIGN, SWAP_BUFFERS, align_up, sub_group_numels, swap_buffer_bytes, swap_file_bytes,
                                     swap_layout)
from hybrid.zero.nvme import SwapError, SwapStore

ADAM = ("master", "exp_avg", "exp_avg_sq")
ROOT = Path(__file__).resolve().parents[2]


def fill(store: SwapStore, seed: int = 0) -> dict:
    """Write distinct values into every record (no read); the values written, by group."""
    written = {}
    gen = torch.Generator().manual_seed(seed)
    for g, views in store.sweep(read=False):
        for name, view in views.items():
            view.copy_(torch.randn(view.numel(), generator=gen))
        written[g] = {name: view.clone() for name, view in views.items()}
    return written


def read_back(store: SwapStore, groups=None) -> dict:
    return {g: {name: view.clone() for name, view in views.items()}
            for g, views in store.sweep(groups, write=False)}


# ------------------------------------------------------------------------------------------- arithmetic

def test_records_are_aligned_end_to_end_and_the_buffers_are_three_of_the_largest():
    layout = swap_layout([1000, 5000, 3], 3)
    assert [r.offset for r in layout.records] == [0, 12288, 73728]  # 12 KB, 60 KB slots
    assert [r.payload for r in layout.records] == [12000, 60000, 36]
    assert all(r.offset % ALIGN == 0 and r.slot % ALIGN == 0 and r.slot >= r.payload for r in layout.records)
    assert layout.file_bytes == 73728 + ALIGN and layout.largest_slot == 61440
    assert layout.buffer_bytes() == SWAP_BUFFERS * (61440 + ALIGN)
    assert sub_group_numels(10, 4) == [4, 4, 2] and sub_group_numels(0, 4) == []
    # 12 bytes per element on disk for AdamW, padded per record; three record buffers in host memory
    assert swap_file_bytes(10**9, 10**8) == 12 * 10**9 + 10 * (-(12 * 10**8) % ALIGN)
    assert swap_buffer_bytes(10**9, 10**8) == 3 * (align_up(12 * 10**8) + ALIGN)
    assert swap_buffer_bytes(5, 10**8) == 3 * (ALIGN + ALIGN) and swap_buffer_bytes(0, 10) == 0
    with pytest.raises(ValueError):
        swap_layout([4, 0], 3)


# ------------------------------------------------------------------------------------------ round trips

@pytest.mark.parametrize("direct", [None, False])
def test_records_come_back_exactly_through_three_buffers(tmp_path, direct):
    numels = [1000, 70_001, 3, 4096, 12_345]  # more records than buffers, none aligned but one
    with SwapStore(tmp_path / "job" / "rank0.swap", numels, ADAM, direct=direct) as store:
        assert direct is None or not store.direct  # O_DIRECT only when allowed (and the filesystem takes it)
        assert os.path.getsize(store.path) == store.layout.file_bytes  # preallocated at once
        assert store.host_bytes == store.layout.buffer_bytes() and len(store.tensors()) == SWAP_BUFFERS
        written = fill(store)
        # a step: read, change in place, written back while the next is read
        for g, views in store.sweep():
            assert torch.equal(views["master"], written[g]["master"])
            views["exp_avg"].mul_(0.5).add_(views["master"])
            written[g]["exp_avg"] = views["exp_avg"].clone()
        got = read_back(store)
        payload = sum(r.payload for r in store.layout.records)
        assert store.bytes_written == store.bytes_read == 2 * payload  # two sweeps wrote, two read
        for g in range(len(numels)):
            for name in ADAM:
                assert torch.equal(got[g][name], written[g][name]), (g, name)
        # any subset, in any order, and a record twice
        got = read_back(store, [3, 0, 3])
        assert torch.equal(got[0]["exp_avg_sq"], written[0]["exp_avg_sq"])
        assert torch.equal(got[3]["master"], written[3]["master"])
        with pytest.raises(IndexError):
            store.sweep([5])
    assert not (tmp_path / "job").exists()  # the file and the directory the store made are gone


def test_two_buffers_are_enough_and_the_order_still_holds(tmp_path):
    with SwapStore(tmp_path / "r.swap", [100] * 7, ("master",), buffers=2) as store:
        written = fill(store, seed=3)
        got = read_back(store, reversed(range(7)))
        assert all(torch.equal(got[g]["master"], written[g]["master"]) for g in range(7))
    with pytest.raises(ValueError):
        SwapStore(tmp_path / "s.swap", [4], ADAM, buffers=1)


def test_a_loop_stopped_early_writes_what_it_finished_and_not_the_record_it_held(tmp_path):
    with SwapStore(tmp_path / "r.swap", [64] * 5, ADAM) as store:
        fill(store)
        before = read_back(store)
        with contextlib.closing(store.sweep()) as records:
            for g, views in records:
                views["master"].fill_(float(g + 1))
                if g == 2:
                    break  # record 2 was changed in its buffer but the loop never finished it
        got = read_back(store)
        assert [got[g]["master"][0].item() for g in (0, 1)] == [1.0, 2.0]
        assert torch.equal(got[2]["master"], before[2]["master"])
        assert torch.equal(got[4]["master"], before[4]["master"])


def test_the_file_goes_with_the_store_but_a_directory_it_did_not_make_stays(tmp_path):
    store = SwapStore(tmp_path / "rank3.swap", [10], ADAM)
    path = store.path
    assert path.exists()
    del store
    gc.collect()
    assert not path.exists() and tmp_path.is_dir()  # the finalizer removed it
    store = SwapStore(tmp_path / "rank3.swap", [10], ADAM)
    store.close()
    store.close()  # idempotent
    with pytest.raises(ValueError, match="closed"):
        store.sweep()


def test_an_existing_file_of_an_earlier_attempt_is_replaced(tmp_path):
    path = tmp_path / "rank0.swap"
    path.write_bytes(b"x" * (1 << 20))
    with SwapStore(path, [10], ADAM) as store:
        assert os.path.getsize(path) == store.layout.file_bytes


# ------------------------------------------------------------------------------------ the disk's errors

def test_a_file_cut_short_is_a_swap_error_that_sticks(tmp_path):
    with SwapStore(tmp_path / "rank0.swap", [1000, 1000], ADAM) as store:
        fill(store)
        os.truncate(store.path, store.layout.records[1].offset + 100)
        with pytest.raises(SwapError) as err:
            read_back(store)
        message = str(err.value)
        assert message.startswith(f"the optimizer states' swap file {store.path} could not be read: it ends before")
        assert "\n" not in message and isinstance(err.value, JobError)
        with pytest.raises(SwapError) as again:  # broken from now on, with the same sentence
            store.sweep()
        assert str(again.value) == message


CHILD = """
import json, os, resource, signal, sys
import torch
from hybrid.zero.nvme import SwapError, SwapStore
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # writes past the limit fail with EFBIG instead of killing us
out = {}
directory = sys.argv[1]
resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, resource.RLIM_INFINITY))
try:  # 1.2 MB of records past a 1 MB limit: preallocation fails, before anything runs
    SwapStore(os.path.join(directory, "big", "rank0.swap"), [100_000], ("master", "exp_avg", "exp_avg_sq"))
except SwapError as err:
    out["create"] = str(err)
out["big_left"] = os.path.exists(os.path.join(directory, "big"))
resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
store = SwapStore(os.path.join(directory, "rank1.swap"), [40_000] * 4, ("master", "exp_avg", "exp_avg_sq"))
for g, views in store.sweep(read=False):
    views["master"].fill_(g)
limit = store.layout.records[2].offset  # writing records 2 and 3 now crosses the limit
resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))
done = []
try:
    for g, views in store.sweep():
        done.append(g)
except SwapError as err:
    out["step"] = str(err)
out["done"] = done
try:
    store.sweep()
except SwapError as err:
    out["again"] = str(err) == out.get("step")
store.close()
out["left"] = os.path.exists(os.path.join(directory, "rank1.swap"))
print(json.dumps(out))
"""


def run_child(script: str, *args: str, prefix: tuple = ()) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([*prefix, sys.executable, "-c", textwrap.dedent(script), *args], env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_the_file_size_limit_fails_creation_and_a_write_mid_sweep_with_one_sentence(tmp_path):
    out = run_child(CHILD, str(tmp_path))
    path = tmp_path / "big" / "rank0.swap"
    assert out["create"].startswith(f"the optimizer states' swap file {path} could not be created (the file size "
                                    "limit (ulimit -f) is reached, EFBIG: it needs 1.2 MB and ")
    assert out["create"].endswith("were free); raise the file size limit (ulimit -f) for the job.")
    assert not out["big_left"]  # the file and the directory made for it are gone
    assert out["step"] == (f"the optimizer states' swap file {tmp_path / 'rank1.swap'} could not be written (the "
                           "file size limit (ulimit -f) is reached, EFBIG); raise the file size limit (ulimit -f) "
                           "for the job.")
    assert 2 <= len(out["done"]) <= 4 and out["again"] and not out["left"]


ENOSPC_CHILD = """
import json, os, subprocess, sys
import torch
from hybrid.zero.nvme import SwapError, SwapStore
mount = sys.argv[1]
subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "none", mount], check=True)
out = {}
try:  # 2.4 MB on a 1 MB disk
    SwapStore(os.path.join(mount, "rank0.swap"), [200_000], ("master", "exp_avg", "exp_avg_sq"))
except SwapError as err:
    out["full"] = str(err)
# 600 KB fits; then someone else fills the disk: the store's blocks are its own, its writes still land
store = SwapStore(os.path.join(mount, "rank1.swap"), [50_000], ("master", "exp_avg", "exp_avg_sq"))
try:
    with open(os.path.join(mount, "filler"), "wb") as f:
        f.write(b"x" * (1 << 20))
except OSError as err:
    out["filler"] = err.errno
for g, views in store.sweep(read=False):
    views["exp_avg"].fill_(7.0)
out["kept"] = [float(views["exp_avg"][0]) for g, views in store.sweep(write=False)]
store.close()
print(json.dumps(out))
"""


def test_a_full_disk_is_refused_at_creation_and_preallocated_blocks_survive_a_disk_filled_later(tmp_path):
    unshare = shutil.which("unshare")
    probe = subprocess.run([unshare, "-rm", "true"], capture_output=True) if unshare else None
    if probe is None or probe.returncode != 0:
        pytest.skip("no user namespaces here (unshare -rm) to mount a small tmpfs in")
    mount = tmp_path / "disk"
    mount.mkdir()
    out = run_child(ENOSPC_CHILD, str(mount), prefix=(unshare, "-rm"))
    assert out["full"].startswith(f"the optimizer states' swap file {mount / 'rank0.swap'} could not be created "
                                  "(the disk is full, ENOSPC: it needs 2.4 MB and ")
    assert out["full"].endswith("free); free space on that disk or point the offload path "
                                "(zero.offload_optimizer.path, or the cluster file's cluster.nvme_path) at a larger "
                                "local disk.")
    assert out["filler"] == 28  # ENOSPC: the disk is full now
    assert out["kept"] == [7.0]


def test_a_ranks_file_lies_in_its_jobs_directory(tmp_path, monkeypatch):
    from hybrid.plan.swap_layout import swap_dir
    from hybrid.zero.nvme import rank_swap_file

    monkeypatch.setenv("HYBRID_JOB_ID", "abc123")
    assert rank_swap_file(tmp_path, 5) == swap_dir(tmp_path, "abc123") / "rank5.swap" == \
        tmp_path / "hybrid-swap-abc123" / "rank5.swap"
    monkeypatch.delenv("HYBRID_JOB_ID")
    assert rank_swap_file(tmp_path, 0).parent.name == f"hybrid-swap-pid{os.getpid()}"
