"""docs/examples/slurm.sbatch, the Slurm batch script docs/your-cluster.md gives: it starts Ray over the job's
allocation (the head on the first node, a worker on each other node through srun), runs ``hybrid launch`` with
``address: auto``, and leaves no Ray process behind.

The run needs a Slurm controller that answers (``sinfo``) and an idle node: a one-node Slurm on this machine
(Debian's ``slurm-wlm``: ``slurmctld`` and ``slurmd`` on localhost, munge) is enough. Where there is none -- CI,
most machines -- the test skips itself. The script's syntax is checked everywhere.
"""

from __future__ import annotations

import re
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from launch.ray.embedded_processes import marked_pids
from tests.unit.test_docs_commands import environment

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "docs" / "examples" / "slurm.sbatch"
JOB_TIMEOUT_S = 300
ENDED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED", "BOOT_FAIL",
         "DEADLINE")


def test_the_script_is_bash_that_parses():
    done = subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def slurm_answers() -> str | None:
    """Why Slurm cannot run the test here, or None when a controller answers with an idle node."""
    if not all(shutil.which(tool) for tool in ("sbatch", "sinfo", "scontrol", "scancel")):
        return "Slurm is not installed (no sbatch, sinfo, scontrol, scancel)"
    try:
        done = subprocess.run(["sinfo", "-h", "-o", "%t"], capture_output=True, text=True, timeout=20)
    except subprocess.TimeoutExpired:
        return "no Slurm controller answers (sinfo timed out)"
    if done.returncode != 0:
        return f"no Slurm controller answers ({done.stderr.strip() or 'sinfo failed'})"
    if not any(state.strip() in ("idle", "mix") for state in done.stdout.split()):
        return f"no idle Slurm node (sinfo: {' '.join(done.stdout.split())})"
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def job_state(job: str) -> tuple[str, str]:
    shown = subprocess.run(["scontrol", "show", "job", "-o", job], capture_output=True, text=True).stdout
    state = re.search(r"JobState=(\S+)", shown)
    code = re.search(r"ExitCode=(\S+)", shown)
    return (state.group(1) if state else "UNKNOWN"), (code.group(1) if code else "?")


@pytest.mark.slow
def test_the_batch_script_starts_ray_over_the_allocation_and_trains_with_address_auto(tmp_path):
    why = slurm_answers()
    if why:
        pytest.skip(why)
    cluster = tmp_path / "cluster.yaml"
    cluster.write_text(f"""\
cluster: {{address: auto, nodes: 1, gpus_per_node: 1, gpu_memory_gb: 80, connect_timeout_s: 120}}
job: {{entrypoint: "hybrid.models.gpt:train", config: {ROOT / "configs" / "gpt-tiny.yaml"}, steps: 2}}
parallel: {{precision: fp32}}
""")
    ray_tmp = tempfile.mkdtemp(prefix="hy-", dir="/tmp")  # short: Ray's socket paths must fit 107 bytes
    env = {**environment(), "RAY_TMPDIR": ray_tmp}
    out = tmp_path / "slurm.out"
    submitted = subprocess.run(["sbatch", "--parsable", "--nodes=1", "--gpus-per-node=0", f"--output={out}",
                                f"--chdir={tmp_path}", f"--export=ALL,RAY_PORT={free_port()}", str(SCRIPT),
                                str(cluster)], env=env, capture_output=True, text=True, timeout=60)
    assert submitted.returncode == 0, submitted.stderr
    job = submitted.stdout.strip().split(";")[0]
    state = "SUBMITTED"
    try:
        deadline = time.monotonic() + JOB_TIMEOUT_S
        state, code = job_state(job)
        while state not in ENDED and time.monotonic() < deadline:
            time.sleep(1)
            state, code = job_state(job)
    finally:
        if state not in ENDED:
            subprocess.run(["scancel", job])
    log = out.read_text() if out.exists() else "(no output file)"
    assert state == "COMPLETED" and code == "0:0", f"job {job}: {state}, exit {code}\n{log}"
    assert re.search(r"connected to Ray at \S+: 1 node", log) and "steps 2/2" in log, log
    deadline = time.monotonic() + 30
    while marked_pids(ray_tmp) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert marked_pids(ray_tmp) == [], "Ray processes of the job are still running"
    shutil.rmtree(ray_tmp, ignore_errors=True)
