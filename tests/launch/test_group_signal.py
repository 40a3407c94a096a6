"""A signal to the launcher's whole process group, as GNU ``timeout``, ``kill -- -PGID`` or a terminal send it.

The embedded cluster's Ray processes run in sessions of their own, so the signal reaches the launcher alone
and its teardown stops them in order: exit 130 within seconds, the ``interrupted`` line, no process of that
cluster left, its temp dir gone and its logs kept in the run dir. Before, a group SIGTERM killed the GCS and
the raylets along with the launcher, whose teardown then waited on the dead GCS until Ray aborted it after
60 s (exit 1, nothing cleaned up). A kill of every process of the job at once (systemd's control-group kill,
Slurm's scancel) does reach the cluster: its GCS stops answering, and the teardown goes on without the calls
that need it (``launch.ray.cluster.within``) instead of waiting for Ray's 60 s abort.
"""

import contextlib
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from launch.job import signals
from launch.ray.embedded_processes import marked_pids
from tests.launch.test_launch_cli import HYBRID, ROOT, _marked_dir, wait_gone

GROUP_STOP_WITHIN_S = 30  # the teardown takes a few seconds; the bug took Ray's 60 s GCS reconnect timeout


def _cluster_file(tmp_path: Path) -> Path:
    path = tmp_path / "cluster.yaml"
    path.write_text(f"""\
cluster: {{address: local, nodes: 2, gpus_per_node: 1, gpu_memory_gb: 80}}
job: {{entrypoint: "hybrid.models.gpt:train", config: {ROOT / "configs" / "gpt-tiny.yaml"}, steps: 5000,
      run_dir: {tmp_path / "run"}}}
parallel: {{precision: fp32}}
""")
    return path


def _start_in_own_session(path: Path) -> subprocess.Popen:
    """``hybrid launch path`` as the leader of a process group of its own (as ``timeout`` or a shell's job
    starts it), with the launcher's own Ray switches left for it to set and SIGHUP at its default (a test run
    under ``nohup`` would otherwise hand the ignore down)."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "RAY_USAGE_STATS_ENABLED", "RAY_ADDRESS")}
    return subprocess.Popen(HYBRID + ["launch", str(path)], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_DFL))


def _pgid(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except ProcessLookupError:
        return None


def _kill_what_is_left(proc: subprocess.Popen, marked: str | None) -> None:
    """Whatever a failed run left: the launcher's group, and the cluster's processes by pid (ours only)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    for pid in marked_pids(marked) if marked else []:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


@pytest.mark.slow
@pytest.mark.timeout(400)
# "every process": systemd's KillMode=control-group or Slurm's scancel, which signal the cluster's processes too
# (its GCS stops answering). Group SIGINT (Ctrl-C) and SIGHUP (the terminal closed) had end-to-end cases here,
# merged into cheaper checks that fail where they did: one handler takes SIGINT, SIGTERM and SIGHUP while the
# embedded cluster runs (test_launch_ray.py, after Ray's nodes installed handlers of their own), a command exits
# 130 on SIGHUP (tests/unit/test_signals.py), the orderly teardown after the interrupt is test_launch_cli.py's
# SIGTERM case, and this case checks that no Ray process shares the launcher's group.
# `make test-all`'s (marked extended): `make test` keeps the SIGTERM teardown and its process-group check in
# test_launch_cli.py and the SIGKILL case below.
@pytest.mark.extended
@pytest.mark.parametrize("signum, every_process", [(signal.SIGTERM, True)], ids=["TERM-every-process"])
def test_a_signal_to_the_launchers_process_group_stops_everything_and_exits_130(tmp_path, signum, every_process):
    """15-30 s a case: each is a user's `hybrid launch` (its own embedded cluster, two rank actors), stopped once
    training is under way, as only a running job has everything the teardown must stop. TERM-every-process is
    the slowest: with its GCS killed too, the teardown's calls to it wait out their timeouts
    (``launch.ray.cluster.within``), which is the path it checks."""
    proc = _start_in_own_session(_cluster_file(tmp_path))
    lines, marked, took = [], None, None
    try:
        for line in proc.stdout:  # wait until training is under way
            lines.append(line)
            if line.startswith("step "):
                break
        marked = _marked_dir(proc.pid)
        ours = marked_pids(marked) if marked else []
        in_group = [pid for pid in ours if _pgid(pid) == proc.pid]
        signalled = time.monotonic()
        os.killpg(proc.pid, signum)
        for pid in ours if every_process else []:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signum)
        out, _ = proc.communicate(timeout=GROUP_STOP_WITHIN_S + 60)
        took = time.monotonic() - signalled
    finally:
        _kill_what_is_left(proc, marked)
    text = "".join(lines) + out
    assert any(l.startswith("step ") for l in lines), text
    assert marked, "no Ray process of the embedded cluster was seen"
    assert proc.returncode == 130, text
    assert took < GROUP_STOP_WITHIN_S, f"took {took:.0f} s\n{text}"
    assert "interrupted" in [l.strip() for l in out.splitlines()], text
    assert "Failed to connect to GCS" not in text, text
    assert marked_pids(marked) == [] and not Path(marked).exists()
    assert wait_gone(proc.pid) == []
    assert (tmp_path / "run" / "ray-logs").is_dir(), "the embedded cluster's logs were not kept"
    # how: the signal never reached the cluster's processes, none of which was in the launcher's group
    assert ours and in_group == [], f"Ray processes in the launcher's process group: {in_group}"
    if every_process:
        assert "error" not in text.lower(), text  # the ranks' deaths are the interrupt's doing, not a failure


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_sigkill_of_the_launcher_leaves_no_process_or_temp_dir_behind(tmp_path):
    """SIGKILL (the OOM killer, ``kill -9``) gives the launcher no teardown: its GCS and raylets die with it,
    their agents did not, and the temp dir stayed. The watchdog (``launch.ray.reaper``) does the teardown.

    About 15 s: an embedded cluster and two rank actors must be running for the SIGKILL to leave them behind."""
    proc = _start_in_own_session(_cluster_file(tmp_path))
    lines, marked, left = [], None, None
    try:
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("step "):
                break
        marked = _marked_dir(proc.pid)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        deadline = time.monotonic() + GROUP_STOP_WITHIN_S
        while (left := marked_pids(marked) if marked else []) or (marked and Path(marked).exists()):
            if time.monotonic() > deadline:
                break
            time.sleep(0.5)
    finally:
        _kill_what_is_left(proc, marked)
    assert any(l.startswith("step ") for l in lines), "".join(lines)
    assert marked, "no Ray process of the embedded cluster was seen"
    assert left == [], f"left running {GROUP_STOP_WITHIN_S} s after the launcher's SIGKILL: {left}"
    assert not Path(marked).exists()
    assert (tmp_path / "run" / "ray-logs").is_dir(), "the embedded cluster's logs were not kept"


def test_with_hangup_adds_sighup_unless_it_is_ignored():
    previous = signal.signal(signal.SIGHUP, signal.SIG_DFL)
    try:
        assert signals.with_hangup() == (*signals.BOTH, signal.SIGHUP)
        signal.signal(signal.SIGHUP, signal.SIG_IGN)  # nohup: a hangup must not stop the job
        assert signals.with_hangup() == signals.BOTH
    finally:
        signal.signal(signal.SIGHUP, previous)
