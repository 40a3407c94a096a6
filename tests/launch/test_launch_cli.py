"""``hybrid launch`` as a user runs it: a subprocess that starts its own embedded Ray cluster.

The launcher must set Ray's loopback and no-usage-stats switches itself (the variables are removed from
the subprocess's environment here), reach nothing but loopback, exit 0 after training, exit 130 on Ctrl-C,
and leave no process of its Ray session behind either way.
"""

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.launch.netcheck import STRACE_CALLS, NetWatch, strace_peers
from tests.launch.test_launch_ray import session_processes

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
HYBRID = [sys.executable, "-c", "import sys; from launch.cli import main; sys.exit(main())"]


def cluster_file(tmp_path, steps: int) -> Path:
    path = tmp_path / "cluster.yaml"
    path.write_text(f"""\
cluster: {{address: local, nodes: 2, gpus_per_node: 2, gpu_memory_gb: 80}}
job: {{entrypoint: "hybrid.models.gpt:train", config: {ROOT / "configs" / "gpt-tiny.yaml"}, steps: {steps}}}
parallel: {{precision: fp32}}
""")
    return path


def start(path: Path, trace_to: Path | None = None) -> subprocess.Popen:
    """``hybrid launch path`` in a subprocess; under ``strace`` (network calls only) when ``trace_to``."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "RAY_USAGE_STATS_ENABLED")}
    tracer = ["strace", "-f", "--seccomp-bpf", "-qq", "-e", STRACE_CALLS, "-o", str(trace_to)] if trace_to else []
    return subprocess.Popen(tracer + HYBRID + ["launch", str(path)], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def strace_works() -> bool:
    if not shutil.which("strace"):
        return False
    return subprocess.run(["strace", "-f", "--seccomp-bpf", "-qq", "-o", os.devnull, "true"], capture_output=True).returncode == 0


def launcher_pid(proc: subprocess.Popen, trace: Path | None) -> int:
    """The pid of the Python launcher (under strace, the traced child named in the log's first line)."""
    if trace is None:
        return proc.pid
    return int(trace.read_text().split(None, 1)[0])


def wait_gone(pid: int, timeout_s: float = 20.0) -> list[str]:
    deadline = time.monotonic() + timeout_s
    while session_processes(pid) and time.monotonic() < deadline:
        time.sleep(0.5)
    return session_processes(pid)


def test_launch_trains_exits_0_and_leaves_nothing(tmp_path):
    """Every socket call of the launcher and all its Ray processes goes through strace where it can."""
    trace = tmp_path / "network.strace" if strace_works() else None
    proc = start(cluster_file(tmp_path, steps=12), trace_to=trace)
    watch = NetWatch(proc.pid).start()
    try:
        out, _ = proc.communicate(timeout=240)
    finally:
        watch.stop()
        proc.kill()
    assert proc.returncode == 0, out
    assert "step 12/12" in out and "steps 12/12" in out and "ZeRO-1" in out
    assert watch.connected_seen > 0 and not watch.violations, (watch.violations, watch.culprits)
    if trace is not None:
        assert trace.stat().st_size > 0 and strace_peers(str(trace)) == set()
    assert wait_gone(launcher_pid(proc, trace)) == [] and watch.wait_survivors() == []


def test_ctrl_c_tears_everything_down(tmp_path):
    proc = start(cluster_file(tmp_path, steps=5000))
    watch = NetWatch(proc.pid).start()
    lines = []
    try:
        for line in proc.stdout:  # wait until training is under way
            lines.append(line)
            if line.startswith("step "):
                break
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=90)
    finally:
        watch.stop()
        proc.kill()
    assert any(l.startswith("step ") for l in lines), "".join(lines)
    assert proc.returncode == 130, "".join(lines) + out
    assert not watch.violations, (watch.violations, watch.culprits)
    assert wait_gone(proc.pid) == [] and watch.wait_survivors() == []


@pytest.mark.skipif(not strace_works(), reason="strace cannot trace here")
def test_the_strace_check_sees_a_child_process_sending_off_the_machine(tmp_path):
    log = tmp_path / "probe.strace"
    child = "import socket; s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.sendto(b'x', ('192.0.2.7', 9))"
    subprocess.run(["strace", "-f", "--seccomp-bpf", "-qq", "-e", STRACE_CALLS, "-o", str(log), sys.executable, "-c",
                    f"import subprocess, sys; subprocess.run([sys.executable, '-c', {child!r}])"], check=True)
    assert strace_peers(str(log)) == {"192.0.2.7"}  # UDP, unconnected, from a grandchild: still seen
