"""Elastic data parallelism end to end (issue 45): ``hybrid launch`` with ``address: auto`` on a local multi-node
Ray cluster (``ray.cluster_utils.Cluster``, one CPU rank per node, loopback only), which the test shrinks and
grows under the running job.

The cluster runs in a process of its own (``tests.launch.elastic_cluster``), driven over stdin, and every launch
is the CLI in a subprocess (``RAY_ADDRESS`` names the cluster), so this test process holds no Ray state. The
ranks train the tiny GPT (fp32, ZeRO auto, 12 sequences per step) with a pause after every step until the test has
removed or added its node (``tests.launch.elastic_entrypoints``: while the run's slow file exists), so that the
node goes or comes between two checkpoints; the steps after that run at full speed. The shrink test (with its
by-hand reference) and the below-min / Ctrl-C test are extended; the grow test, one launch, is not.
"""

import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from hybrid.checkpoint import layout
from launch.job.metrics import read_metrics
from launch.ray.cluster import LOOPBACK_ONLY_ENV
from tests.launch.elastic_cases import GLOBAL_BATCH, MICRO_BATCH, ROOT, stage_changing_memory_gb
from tests.launch.elastic_entrypoints import SLOW_FILE

pytestmark = pytest.mark.slow

HYBRID = [sys.executable, "-c", "import sys; from launch.cli import main; sys.exit(main())"]
ENTRYPOINT = "tests.launch.elastic_entrypoints:train_slowly"
STEPS, EVERY = 10, 3
RUN_S = 240  # one launch, start to finish, on 2 shared cores


def environment(**extra) -> dict:
    return {**os.environ, **LOOPBACK_ONLY_ENV, "PYTHONPATH": str(ROOT), **extra}


class RayNodes:
    """The cluster process of ``tests.launch.elastic_cluster``: its address, ``remove()`` and ``add()``."""

    def __init__(self, nodes: int):
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.launch.elastic_cluster", str(nodes)], cwd=ROOT,
                                     env=environment(), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline()
        assert line.startswith("address "), line
        self.address = line.split()[1]
        self.nodes = nodes

    def _command(self, command: str, answer: str) -> str:
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline().strip()
        assert line.startswith(answer), f"{command}: {line!r}"
        return line

    def remove(self) -> str:
        self.nodes -= 1
        return self._command("remove", "removed ")

    def add(self, ready: bool = True) -> str:
        """A node, once it has run a task that imports torch (``ready``), else once Ray lists it alive."""
        self.nodes += 1
        return self._command("add" if ready else "join", "added ")

    def ensure(self, nodes: int) -> None:
        """Add or remove nodes until there are ``nodes``, every one able to run a rank (the tests share the
        cluster and each starts at the size it needs)."""
        while self.nodes < nodes:
            self.add()
        while self.nodes > nodes:
            self.remove()

    def close(self) -> None:
        try:
            self.proc.stdin.write("quit\n")
            self.proc.stdin.flush()
            self.proc.wait(timeout=60)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture(scope="module")
def ray_nodes():
    nodes = RayNodes(3)
    try:
        yield nodes
    finally:
        nodes.close()


def cluster_file(tmp_path: Path, run: str, nodes: int, failure: str = "", steps: int = STEPS,
                 gpu_memory_gb: float = 80.0) -> Path:
    """The job of ``tests.launch.elastic_cases`` on the running cluster (``address: auto``), its steps slowed
    while ``slow_file(tmp_path, run)`` exists."""
    path = tmp_path / f"{run}.yaml"
    path.write_text(f"""\
cluster: {{address: auto, nodes: {nodes}, gpus_per_node: 1, gpu_memory_gb: {gpu_memory_gb!r}}}
job: {{entrypoint: "{ENTRYPOINT}", config: {ROOT / "configs" / "gpt-tiny.yaml"}, steps: {steps}, micro_batch: {MICRO_BATCH},
      global_batch: {GLOBAL_BATCH}, checkpoint: {{dir: {tmp_path / run}, every: {EVERY}, keep_last: 20}},
      max_failures: 2, placement_timeout_s: 30, working_dir: {ROOT}, env: {{{SLOW_FILE}: {slow_file(tmp_path, run)}}}}}
parallel: {{tp: 1, precision: fp32, offload: false}}
{failure}
""")
    return path


def slow_file(tmp_path: Path, run: str) -> Path:
    return tmp_path / f"{run}.slow"


def slowed(tmp_path: Path, run: str) -> Path:
    """Slow the steps of ``run`` until the file returned is deleted."""
    path = slow_file(tmp_path, run)
    path.touch()
    return path


def launch(path: Path, address: str) -> subprocess.Popen:
    return subprocess.Popen(HYBRID + ["launch", str(path)], cwd=ROOT, env=environment(RAY_ADDRESS=address),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)


def wait_for_step(run_dir: Path, step: int, proc: subprocess.Popen, timeout_s: float = RUN_S) -> None:
    """Until metrics.jsonl holds ``step`` (the launcher still running)."""
    path = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.stdout.read()
        if path.exists() and any(e.get("step", 0) >= step and "loss" in e for e in read_metrics(path)):
            return
        time.sleep(0.2)
    raise AssertionError(f"step {step} not reached within {timeout_s} s")


def finish(proc: subprocess.Popen) -> str:
    try:
        out, _ = proc.communicate(timeout=RUN_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
    return out


def losses(run_dir: Path) -> dict:
    return {e["step"]: (e["loss"], e["grad_norm"]) for e in read_metrics(run_dir / "metrics.jsonl") if "loss" in e}


def rank_processes() -> list[str]:
    """The rank actors alive on this machine (Ray titles a busy actor's process ``ray::RankActor...``)."""
    out = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if line.startswith("ray::RankActor")]


class Lines:
    """A launcher's output, read as it comes (``wait_for`` a pattern)."""

    def __init__(self, proc: subprocess.Popen):
        self.proc, self.lines = proc, []
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)

    def wait_for(self, pattern: str, timeout_s: float = RUN_S) -> str:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            found = [line for line in list(self.lines) if re.search(pattern, line)]
            if found:
                return found[0]
            assert self.proc.poll() is None or self.thread.is_alive(), "".join(self.lines)
            time.sleep(0.2)
        raise AssertionError(f"{pattern!r} not printed within {timeout_s} s:\n{''.join(self.lines)}")

    def text(self) -> str:
        self.thread.join(timeout=60)
        return "".join(self.lines)


@pytest.mark.extended  # the costliest: three launches (about 130 s on 2 shared cores)
def test_a_lost_node_shrinks_the_job_to_dp_2_at_stage_2_with_the_global_batch_kept(ray_nodes, tmp_path):
    """Three launches' worth of rank actors (3, then 2, then the by-hand reference's 2), each importing torch. The
    declared GPU memory fits ZeRO-1 at DP 3 and not at DP 2 (``stage_changing_memory_gb``): the resize also
    changes the stage, and its line says why."""
    ray_nodes.ensure(3)
    run = tmp_path / "run"
    memory = stage_changing_memory_gb()
    slow = slowed(tmp_path, "run")
    proc = launch(cluster_file(tmp_path, "run", 3, "failure: {elastic: {min_nodes: 2, grace_s: 0.5}}",
                               gpu_memory_gb=memory), ray_nodes.address)
    wait_for_step(run, EVERY + 1, proc)
    ray_nodes.remove()
    slow.unlink()
    out = finish(proc)
    assert proc.returncode == 0, out
    entries = read_metrics(run / "metrics.jsonl")
    resizes = [e for e in entries if e.get("event") == "resize"]
    assert len(resizes) == 1, out
    resize = resizes[0]
    assert (resize["nodes_before"], resize["nodes_after"]) == (3, 2)
    assert resize["plan_before"]["dp"] == 3 and resize["plan"]["dp"] == 2
    assert (resize["plan_before"]["stage"], resize["plan"]["stage"]) == (1, 2), out
    assert resize["plan_before"]["global_batch"] == resize["plan"]["global_batch"] == GLOBAL_BATCH
    assert resize["plan"]["micro_batch"] * resize["plan"]["accumulation"] == GLOBAL_BATCH // 2
    resumed = resize["resumed_from"]
    saved = sorted(e.step for e in layout.scan(run) if e.complete)
    assert resumed in saved and resumed % EVERY == 0
    # only the steps after the last checkpoint were computed twice
    # (EVERY of them only where the node went while the next checkpoint was being written)
    assert all(s > resumed for s in resize["steps_computed_twice"]) and len(resize["steps_computed_twice"]) <= EVERY
    line = next(line for line in out.splitlines() if line.startswith("resize 3 -> 2 nodes (1 node lost"))
    assert "dp 3 -> 2, stage 1 -> 2, accumulation 2 -> 3, global batch 12 kept" in line, line
    assert "plan: still OOM with sharded optimizer, fits with gradient sharding: stage 1 needs" in line, line
    assert (run / "resizes.jsonl").read_text().count("\n") == 1
    after = losses(run)
    assert sorted(after) == list(range(1, STEPS + 1))

    # the reference: that checkpoint resumed by hand at 2 nodes with the same global batch
    ref = tmp_path / "ref"
    checkpoint = next(e.path for e in layout.scan(run) if e.step == resumed)
    shutil.copytree(checkpoint, layout.checkpoints_dir(ref) / checkpoint.name)
    reference = launch(cluster_file(tmp_path, "ref", 2, gpu_memory_gb=memory), ray_nodes.address)
    ref_out = finish(reference)
    assert reference.returncode == 0, ref_out
    expected = {s: v for s, v in losses(ref).items() if s > resumed}
    assert sorted(expected) == list(range(resumed + 1, STEPS + 1))
    assert {s: v for s, v in after.items() if s > resumed} == expected


def test_a_node_that_joins_grows_the_job_at_its_next_checkpoint(ray_nodes, tmp_path):
    ray_nodes.ensure(2)
    run = tmp_path / "run"
    steps = 3 * STEPS  # time for the new node to start and be probed while checkpoints are still to come
    slow = slowed(tmp_path, "run")
    proc = launch(cluster_file(tmp_path, "run", 2, "failure: {elastic: {max_nodes: 3}}", steps), ray_nodes.address)
    wait_for_step(run, 1, proc)
    lines = Lines(proc)
    ray_nodes.add(ready=False)  # as a node joins a running job: its first rank may be the node's first worker
    lines.wait_for(r"^resize 2 -> 3 nodes")
    slow.unlink()
    proc.wait(timeout=RUN_S)
    out = lines.text()
    assert proc.returncode == 0, out
    resizes = [e for e in read_metrics(run / "metrics.jsonl") if e.get("event") == "resize"]
    assert [(r["nodes_before"], r["nodes_after"], r["why"]) for r in resizes] == [(2, 3, "1 node joined")], out
    resize = resizes[0]
    assert resize["plan"]["dp"] == 3 and resize["plan"]["global_batch"] == GLOBAL_BATCH
    assert resize["resumed_from"] % EVERY == 0 and resize["resumed_from"] > 0  # at a checkpoint after the join
    assert sorted(losses(run)) == list(range(1, steps + 1))
    assert "resize 2 -> 3 nodes (1 node joined)" in out


@pytest.mark.extended  # a 3-rank and a 2-rank launch; the sentence and the search are unit-tested too (test_elastic.py)
def test_below_min_nodes_exits_1_and_ctrl_c_while_waiting_leaves_no_rank_behind(ray_nodes, tmp_path):
    ray_nodes.ensure(3)
    run = tmp_path / "run"
    slowed(tmp_path, "run")
    proc = launch(cluster_file(tmp_path, "run", 3, "failure: {elastic: {min_nodes: 3, grace_s: 0.5}}"),
                  ray_nodes.address)
    wait_for_step(run, EVERY + 1, proc)
    ray_nodes.remove()
    out = finish(proc)
    assert proc.returncode == 1, out
    last = out.strip().splitlines()[-1]
    assert re.search(r"2 usable nodes left \(.*\), below failure\.elastic\.min_nodes = 3; the smallest count that "
                     r"would run it is 3; checkpoint step \d+ in .* is intact", last), out
    saved = [e for e in layout.scan(run) if e.complete]
    assert saved and all(e.complete for e in layout.scan(run))

    # on the 2 nodes left: the ranks placed (running), one of their nodes goes
    slowed(tmp_path, "interrupted")
    proc = launch(cluster_file(tmp_path, "interrupted", 2, "failure: {elastic: {min_nodes: 1, grace_s: 120}}"),
                  ray_nodes.address)
    lines = Lines(proc)
    lines.wait_for(r"^placed ")
    ray_nodes.remove()
    lines.wait_for(r"1 node of 2 lost; waiting up to failure\.elastic\.grace_s = 120 s")
    os.killpg(proc.pid, signal.SIGINT)
    proc.wait(timeout=60)
    assert proc.returncode == 130, lines.text()
    deadline = time.monotonic() + 20
    while rank_processes() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert rank_processes() == []
