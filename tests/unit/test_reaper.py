"""The embedded cluster's watchdog (``launch.ray.reaper``): a real watchdog process and a real marked process."""

import os
import subprocess
import sys
import time

from launch.ray.embedded_processes import alive, marked_pids
from launch.ray.cluster import EMBEDDED_PREFIX
from launch.ray.reaper import Reaper


def _cluster_like(tmp_path):
    """A temp dir with session logs, and a process marked by it as a Ray agent is (``RAY_TMPDIR``)."""
    base = tmp_path / f"{EMBEDDED_PREFIX}test"
    (base / "ray" / "session_2026-12-03" / "logs").mkdir(parents=True)
    (base / "ray" / "session_2026-12-03" / "logs" / "raylet.out").write_text("raylet log")
    agent = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"],
                             env={**os.environ, "RAY_TMPDIR": str(base)})
    return base, agent


def test_a_released_watchdog_exits_and_touches_nothing(tmp_path):
    base, agent = _cluster_like(tmp_path)
    try:
        reaper = Reaper.start(str(base), tmp_path / "logs")
        assert reaper is not None and agent.pid in marked_pids(str(base))
        assert reaper._process.pid not in marked_pids(str(base))  # never counted among the cluster's
        reaper.release()
        assert reaper._process.returncode == 0
        assert alive(agent.pid) and base.is_dir() and not (tmp_path / "logs").exists()
    finally:
        agent.kill()
        agent.wait()


def test_a_watchdog_whose_launcher_is_gone_stops_the_cluster_keeps_its_logs_and_removes_its_dir(tmp_path):
    base, agent = _cluster_like(tmp_path)
    try:
        reaper = Reaper.start(str(base), tmp_path / "run" / "ray-logs")
        os.close(reaper._pipe)  # what the launcher's death does: its end of the pipe closes, no "done"
        reaper._process.wait(timeout=30)
        deadline = time.monotonic() + 10
        while agent.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert agent.poll() is not None, "the cluster's process outlived the watchdog"
        assert not base.exists()
        assert (tmp_path / "run" / "ray-logs" / "raylet.out").read_text() == "raylet log"
    finally:
        agent.kill()
        agent.wait()
