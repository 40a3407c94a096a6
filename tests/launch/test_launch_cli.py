"""``hybrid launch`` as a user runs it: a subprocess that starts its own embedded Ray cluster.

The launcher must set Ray's loopback and no-usage-stats switches itself (the variables are removed from
the subprocess's environment here), reach nothing but loopback, exit 0 after training, 1 when a rank
raises, 130 on Ctrl-C or SIGTERM (during training, while the embedded cluster starts, or while it
waits for a remote cluster to answer), and leave no process of its Ray session behind in every case.
"""

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from launch.ray.embedded_processes import marked_pids
from launch.ray.cluster import EMBEDDED_PREFIX, PROXY_VARS
from tests.launch.netcheck import STRACE_CALLS, NetWatch, descendants, session_processes, strace_peers

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
STOP_WITHIN_S = 10  # Ctrl-C or SIGTERM during connect or start-up must stop everything within this
HYBRID = [sys.executable, "-c", "import sys; from launch.cli import main; sys.exit(main())"]


def cluster_file(tmp_path, steps: int, entrypoint: str = "hybrid.models.gpt:train",
                 cluster: str = "address: local", run_dir: Path | None = None) -> Path:
    """Two nodes of one rank each: a ZeRO job across nodes with the fewest rank actors (each imports torch).
    TP inside a node and the 2 x 2 placement are tests/launch/test_launch_ray.py's, on the shared cluster."""
    path = tmp_path / "cluster.yaml"
    run = f", run_dir: {run_dir}" if run_dir else ""
    path.write_text(f"""\
cluster: {{{cluster}, nodes: 2, gpus_per_node: 1, gpu_memory_gb: 80}}
job: {{entrypoint: "{entrypoint}", config: {ROOT / "configs" / "gpt-tiny.yaml"}, steps: {steps}{run}}}
parallel: {{precision: fp32}}
""")
    return path


def start(path: Path, trace_to: Path | None = None, env: dict | None = None) -> subprocess.Popen:
    """``hybrid launch path`` in a subprocess; under ``strace`` (network calls only) when ``trace_to``."""
    env = {**{k: v for k, v in os.environ.items()
              if k not in ("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "RAY_USAGE_STATS_ENABLED", "RAY_ADDRESS")
              and k not in PROXY_VARS},  # a user's launch: no proxy pointed at loopback for it
           **(env or {})}
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
    """Every socket call of the launcher and all its Ray processes goes through strace where it can.

    Over 20 s: a user's `hybrid launch` starts its own embedded cluster (GCS, two raylets and their agents) and
    two rank actors that import torch, all under strace; the 12 steps themselves take about a second."""
    trace = tmp_path / "network.strace" if strace_works() else None
    proc = start(cluster_file(tmp_path, steps=12), trace_to=trace)
    watch = NetWatch(proc.pid).start()
    try:
        out, _ = proc.communicate(timeout=240)
    finally:
        watch.stop()
        proc.kill()
    assert proc.returncode == 0, out
    assert "step 12/12" in out and "steps 12/12" in out and re.search(r"stage   ZeRO-[0-3]", out)
    assert "tokens/s" in out and "<- chosen" in out  # the layouts ranked by time, and the chosen one run
    assert re.search(r"step time: predicted [\d.]+ m?s \(tp\d z\d mb \d+.*\), measured [\d.]+ m?s", out), out
    assert watch.connected_seen > 0 and not watch.violations, (watch.violations, watch.culprits)
    if trace is not None:
        assert trace.stat().st_size > 0 and strace_peers(str(trace)) == set()
    assert wait_gone(launcher_pid(proc, trace)) == [] and watch.wait_survivors() == []


def test_sigterm_to_the_launcher_alone_tears_everything_down_and_exits_130(tmp_path):
    """``kill PID``, and the orderly teardown any interrupt takes: exit 130, the ``interrupted`` line, no
    process of the embedded cluster left, its temp dir gone, its logs kept in the run dir. Ctrl-C (SIGINT),
    a group SIGTERM and a hangup take the same teardown: one handler serves all three while the cluster runs
    (test_launch_ray.py); test_group_signal.py sends a group SIGTERM that also reaches every Ray process.
    (A group SIGINT had an end-to-end case of its own there, merged into this one and those two: it checked
    this teardown and that no Ray process shares the launcher's process group, as the group SIGTERM case does.)

    About 20 s: an embedded cluster and two rank actors must start before training is under way, and the
    teardown that follows the signal is what the test checks."""
    proc = start(cluster_file(tmp_path, steps=5000, run_dir=tmp_path / "run"))
    watch = NetWatch(proc.pid).start()
    lines, marked = [], None
    try:
        for line in proc.stdout:  # wait until training is under way
            lines.append(line)
            if line.startswith("step "):
                break
        marked = _marked_dir(proc.pid)
        ours = marked_pids(marked) if marked else []
        launcher_group = _pgid(proc.pid)
        in_group = [pid for pid in ours if _pgid(pid) == launcher_group]
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=90)
    finally:
        watch.stop()
        proc.kill()
    text = "".join(lines) + out
    assert any(l.startswith("step ") for l in lines), text
    assert proc.returncode == 130, text
    assert "interrupted" in [l.strip() for l in out.splitlines()], text
    assert "Failed to connect to GCS" not in text, text
    assert not watch.violations, (watch.violations, watch.culprits)
    assert wait_gone(proc.pid) == [] and watch.wait_survivors() == []
    assert marked and ours, "no Ray process of the embedded cluster was seen"
    assert in_group == [], f"Ray processes in the launcher's process group: {in_group}"  # a group signal's reach
    assert marked_pids(marked) == [] and not Path(marked).exists()
    assert (tmp_path / "run" / "ray-logs").is_dir(), "the embedded cluster's logs were not kept"


@pytest.mark.skipif(not strace_works(), reason="strace cannot trace here")
def test_the_strace_check_sees_a_child_process_sending_off_the_machine(tmp_path):
    log = tmp_path / "probe.strace"
    child = "import socket; s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.sendto(b'x', ('192.0.2.7', 9))"
    subprocess.run(["strace", "-f", "--seccomp-bpf", "-qq", "-e", STRACE_CALLS, "-o", str(log), sys.executable, "-c",
                    f"import subprocess, sys; subprocess.run([sys.executable, '-c', {child!r}])"], check=True)
    assert strace_peers(str(log)) == {"192.0.2.7"}  # UDP, unconnected, from a grandchild: still seen


def test_a_rank_that_raises_exits_1_naming_it(tmp_path):
    proc = start(cluster_file(tmp_path, steps=3, entrypoint="tests.launch.entrypoints:fail_on_rank_1"))
    try:
        out, _ = proc.communicate(timeout=240)
    finally:
        proc.kill()
    assert proc.returncode == 1, out
    assert "error: rank 1 on node 1 failed (RuntimeError: rank one is broken on purpose)" in out, out
    assert wait_gone(proc.pid) == []


def _pgid(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except ProcessLookupError:
        return None


def _marked_dir(pid: int) -> str | None:
    """The embedded cluster's temp dir, once a Ray process below ``pid`` runs with it."""
    for child in descendants(pid):
        try:
            args = Path(f"/proc/{child}/cmdline").read_bytes().decode(errors="replace").replace("\0", " ")
        except OSError:
            continue
        found = re.search(rf"/\S*/{EMBEDDED_PREFIX}[^/\s]+", args)
        if found:
            return found.group(0)
    return None


def test_sigterm_while_the_embedded_cluster_starts_stops_every_process_of_it(tmp_path):
    proc = start(cluster_file(tmp_path, steps=5000))
    watch = NetWatch(proc.pid).start()
    try:
        deadline = time.monotonic() + 120
        marked = None
        while marked is None and proc.poll() is None and time.monotonic() < deadline:
            marked = _marked_dir(proc.pid)  # the first Ray process of the cluster is up: mid start-up
            time.sleep(0.05)
        assert marked, "no Ray process of the embedded cluster was seen starting"
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=STOP_WITHIN_S)
    finally:
        watch.stop()
        proc.kill()
    assert proc.returncode == 130, out
    assert "step " not in out, out  # it was stopped before training began
    assert marked_pids(marked) == [] and not Path(marked).exists()
    assert wait_gone(proc.pid) == [] and watch.wait_survivors() == []


def test_sigterm_while_waiting_for_a_remote_cluster_exits_130_at_once(tmp_path):
    """A Ray address that accepts connections and never answers: the launcher must not hang in connect."""
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(16)
        port = silent.getsockname()[1]
        env = {"RAY_ADDRESS": f"127.0.0.1:{port}"}
        proc = start(cluster_file(tmp_path, steps=3, cluster="address: auto, connect_timeout_s: 600"), env=env)
        try:
            for line in proc.stdout:
                if line.startswith("connecting to Ray at auto"):
                    break
            time.sleep(1.0)  # inside the connect
            proc.send_signal(signal.SIGTERM)
            out, _ = proc.communicate(timeout=STOP_WITHIN_S)
        finally:
            proc.kill()
    assert proc.returncode == 130, out


@pytest.mark.extended  # make test-all's (CI time): see the README
def test_a_cluster_the_user_started_is_joined_by_ray_client_and_by_auto(tmp_path):
    """`ray start --head` on loopback (in its own temp dir, stopped by its pid): `ray://` (Ray Client) and
    `auto` (the address `ray start` recorded) both run the job; the launcher says where it connected.

    The slowest test: a cluster started as a user starts it (not the embedded kind the other tests use), a
    Ray Client connection (whose server process the head starts for the driver) and a second driver through
    `auto`, each placing one rank actor; one cluster serves both addresses, and 2 steps are the least that
    shows the job ran."""
    ray_tmp = Path(tempfile.mkdtemp(prefix="hy-", dir="/tmp"))  # short: Ray's socket paths must fit 107 bytes
    # A token where Ray looks for one (as ~/.ray/auth_token is once any plain ray.init() ran): `ray start`
    # then requires it, and the launcher must send it (it timed out without).
    token = ray_tmp / "auth_token"
    token.write_text("0123456789abcdef0123456789abcdef")
    auth = {"RAY_AUTH_TOKEN_PATH": str(token)}
    env = {**{k: v for k, v in os.environ.items() if k != "RAY_AUTH_MODE"}, "RAY_TMPDIR": str(ray_tmp), **auth}
    env.pop("RAY_ADDRESS", None)
    ports = []
    for _ in range(2):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            ports.append(s.getsockname()[1])
    head = subprocess.Popen([str(Path(sys.executable).parent / "ray"), "start", "--head", "--block",
                             "--node-ip-address=127.0.0.1", f"--port={ports[0]}", f"--ray-client-server-port={ports[1]}",
                             "--num-cpus=2", "--num-gpus=0", "--include-dashboard=false", "--disable-usage-stats"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        started = []
        for line in head.stdout:  # until the head says it is up and will block
            started.append(line)
            if "block forever" in line:
                break
        assert head.poll() is None and (ray_tmp / "ray" / "ray_current_cluster").exists(), "".join(started)
        for address, shown in ((f'"ray://127.0.0.1:{ports[1]}"', f"ray://127.0.0.1:{ports[1]}: 1 node"),
                               ("auto", f"127.0.0.1:{ports[0]}: 1 node")):
            path = tmp_path / "cluster.yaml"
            path.write_text(f"""\
cluster: {{address: {address}, nodes: 1, gpus_per_node: 1, gpu_memory_gb: 80, connect_timeout_s: 60}}
job: {{entrypoint: "hybrid.models.gpt:train", config: {ROOT / "configs" / "gpt-tiny.yaml"}, steps: 2}}
parallel: {{precision: fp32}}
""")
            # the launcher pins loopback only for the embedded cluster: a remote one is the user's to set up
            proc = start(path, env={"RAY_TMPDIR": str(ray_tmp), "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
                                    "RAY_USAGE_STATS_ENABLED": "0", **auth})
            try:
                out, _ = proc.communicate(timeout=240)
            finally:
                proc.kill()
            assert proc.returncode == 0, out
            assert f"connected to Ray at {shown}" in out and "steps 2/2" in out, out
    finally:
        head.send_signal(signal.SIGTERM)  # `ray start --block` stops every process of its cluster
        head.communicate(timeout=60)
    assert marked_pids(str(ray_tmp)) == []
    shutil.rmtree(ray_tmp, ignore_errors=True)
