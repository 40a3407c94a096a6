"""The disk behind NVMe offload, checked before a job starts (``launch.planning.nvme_space``): a path on a disk too
small for the ranks' swap files, or on a read-only one, is one sentence naming the path (what the driver says
before any rank starts, exit 2); a path on a disk with room passes and the plan says where its figure came from.
The small and the read-only disks are real: tmpfs mounts in a user namespace of their own (skipped where the
system allows none)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from launch.planning.nvme_space import disk_space

ROOT = Path(__file__).resolve().parents[2]

CHILD = r"""
import json, subprocess, sys
from pathlib import Path
from launch.planning.nvme_space import check_nvme_space
from launch.planning.plan import build_plan
from launch.spec import parse_spec

root, full, read_only, roomy = (Path(p) for p in sys.argv[1:5])
subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "none", str(full)], check=True)
subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "none", str(read_only)], check=True)
out = {}
for name, path in (("full", full), ("read_only", read_only), ("roomy", roomy)):
    spec = parse_spec({"cluster": {"address": "local", "nodes": 1, "gpus_per_node": 2, "gpu_memory_gb": 80,
                                   "nvme_path": str(path / "swap")},
                       "job": {"entrypoint": "hybrid.models.gpt:train", "config": "configs/gpt-tiny.yaml",
                               "steps": 2},
                       "parallel": {"tp": 1, "zero_stage": 3, "offload": "nvme"}}, base_dir=root)
    try:
        lp = build_plan(spec)
        check_nvme_space(lp, None)
        out[name] = ["ok", lp.nvme_note]
    except Exception as err:
        out[name] = [type(err).__name__, str(err)]
print(json.dumps(out))
"""


def test_a_full_or_read_only_path_is_one_sentence_before_the_job_starts(tmp_path):
    unshare = shutil.which("unshare")
    probe = subprocess.run([unshare, "-rm", "true"], capture_output=True) if unshare else None
    if probe is None or probe.returncode != 0:
        pytest.skip("no user namespaces here (unshare -rm) to mount a small tmpfs in")
    paths = [tmp_path / name for name in ("full", "ro", "roomy")]
    for path in paths:
        path.mkdir()
    done = subprocess.run([unshare, "-rm", sys.executable, "-c", CHILD, str(ROOT), *map(str, paths)],
                          capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    full, read_only, roomy = out["full"], out["read_only"], out["roomy"]
    for kind, text in (full, read_only):
        assert kind == "PlanError" and "\n" not in text and text.endswith("."), text
    assert full[1].startswith(f"cluster.nvme_path {paths[0] / 'swap'} has 65.536 KB free on this machine, but the "
                              "optimizer states offloaded to NVMe need ") and "(2 ranks x " in full[1], full[1]
    assert read_only[1] == (f"cluster.nvme_path {paths[1] / 'swap'} cannot hold the optimizer states' swap files on "
                            f"this machine: {paths[1]} is not writable (Read-only file system); point it at a "
                            "writable directory on the local NVMe disk."), read_only[1]
    assert roomy[0] == "ok" and roomy[1].startswith(f"NVMe space measured here: "), roomy


def test_disk_space_names_what_stands_in_the_way(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    assert disk_space(blocker / "swap") == (None, f"{blocker} is a file")
    free, problem = disk_space(tmp_path / "not" / "yet")  # the ranks create it: its nearest existing ancestor
    assert problem is None and free > 0
