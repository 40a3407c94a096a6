"""The README's "bring your own data and cluster" example, run as a user would: ``hybrid data prepare`` and
``hybrid launch examples/byo/cluster.yaml`` from another directory, on an embedded Ray cluster.

The entrypoint module (my_train.py) is importable only from the example's directory, which the job ships to
the ranks as Ray's working_dir; the ranks see job.env, print lines that reach the driver prefixed with
their rank (and Ray's session logs, which the summary names), and metrics.jsonl gets one line per step.
"""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.launch.test_launch_cli import HYBRID, wait_gone

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
ANSI = re.compile(r"\x1b\[[0-9;]*m")


def hybrid(args, cwd, timeout=240):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.Popen(HYBRID + args, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    finally:
        proc.kill()
    return proc, ANSI.sub("", out)


def test_the_readme_example_runs_from_another_directory_with_its_code_shipped(tmp_path):
    assert "examples/byo/cluster.yaml" in (ROOT / "docs" / "launching-and-faults.md").read_text()
    byo = tmp_path / "byo"
    shutil.copytree(ROOT / "examples" / "byo", byo, ignore=shutil.ignore_patterns("runs", "corpus.bin*", "__pycache__"))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    assert not (elsewhere / "my_train.py").exists()

    proc, out = hybrid(["data", "prepare", str(ROOT / "README.md"), str(ROOT / "hybrid" / "runtime" / "train.py"),
                        "--out", str(byo / "corpus.bin")], cwd=elsewhere)
    assert proc.returncode == 0 and "tokens (uint16, vocabulary 256, tokenizer bytes)" in out, out

    (byo / "runs" / "byo").mkdir(parents=True)
    (byo / "runs" / "byo" / "left-from-before.txt").write_text("the run directory is never shipped")
    proc, out = hybrid(["launch", str(byo / "cluster.yaml")], cwd=elsewhere)
    assert proc.returncode == 0, out
    assert "steps 20/20" in out and "tokens/s" in out
    assert re.search(r"final loss [0-9.]+ nats \(mean of the last 10 steps\), (not yet )?below the unigram "
                     r"entropy of the data \([0-9.]+ nats\)", out), out

    # what a rank prints reaches the terminal named by its rank; all of it is in the session logs
    greetings = re.findall(r"^\(rank ([01]) pid=\d+[^)]*\) hello from rank ([01]) of 2 in (\S+) holding (\S+)$",
                           out, re.M)
    assert greetings and all(prefix == rank for prefix, rank, _, _ in greetings), out
    for _, _, cwd, held in greetings:  # the rank ran in the shipped copy, which left the run directory out
        held = held.split(",")
        assert Path(cwd) != byo and "my_train.py" in held and "corpus.bin" in held and "runs" not in held
    logs = Path(re.search(r"^full rank logs \(stdout/stderr of every worker\): (\S+)$", out, re.M).group(1))
    assert logs == byo / "runs" / "byo" / "ray-logs"  # kept after the embedded cluster is gone
    logged = "".join(p.read_text(errors="replace") for p in logs.glob("worker-*.out"))
    assert all(f"hello from rank {r} of 2" in logged for r in (0, 1))

    rows = [json.loads(line) for line in (byo / "runs" / "byo" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 21))
    assert all(r["throughput_unit"] == "tokens/s" and r["ranks_reported"] == 2 for r in rows)
    assert wait_gone(proc.pid) == []
