"""Connect the driver to the Ray cluster a spec names, and always let go of it.

``connect(cluster_spec)`` is a context manager yielding a ``Connected`` (the address and the count of
live nodes, for the display). ``address: local`` starts an embedded Ray cluster with one Ray node per
declared node (``ray.cluster_utils.Cluster``), every process bound to 127.0.0.1, no dashboard, no usage
stats, after ``launch.ray.capacity`` confirmed this machine can host it. Its Ray temp dir is a fresh
``hybrid-ray-*`` directory (``RAY_TMPDIR``): that marks every one of its processes as ours, keeps its
address out of ``/tmp/ray/ray_current_cluster`` (where ``address: auto`` of another process would find
it), and lets the teardown kill any process of it that a Ctrl-C in the middle of a node's start left
unregistered. Leaving the block (normally, on an error, on Ctrl-C or SIGTERM) shuts the driver and every
node down. Its Ray processes run in sessions of their own, so a signal to the launcher's process group
(a terminal's Ctrl-C or hangup, GNU ``timeout``, ``kill -- -PGID``) reaches the launcher alone and the
teardown stops them in order; while it runs, SIGHUP is an interrupt too unless ignored (``nohup``).

``auto`` and ``ray://host:port`` attach to a running cluster, start nothing and only disconnect on exit.
``auto`` means ``RAY_ADDRESS`` when set, else the cluster ``ray start`` recorded in Ray's default temp
dir, never an embedded cluster of another ``hybrid`` process (``is_embedded``). The connection must
succeed within ``cluster.connect_timeout_s`` (a TCP probe first, then ``ray.init``), else one sentence
(``ConfigError``: exit 2). SIGINT and SIGTERM raise ``KeyboardInterrupt`` throughout (exit 130).

Each embedded node ``i`` carries the custom resource ``hybrid_node_<i>`` and ``gpus_per_node`` logical
CPUs (one per rank, whatever the physical core count), so ranks and probes can be placed per node.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Mapping, Optional

from hybrid.errors import ConfigError, first_line
from hybrid.config.validate import quote
from launch.job import signals
from launch.ray.capacity import check_embedded
from launch.ray.embedded_processes import alive, clean_up, processes
from launch.ray.reaper import Reaper
from launch.spec import ClusterSpec

log = logging.getLogger(__name__)

LOOPBACK = "127.0.0.1"
EMBEDDED_PREFIX = "hybrid-ray-"  # the temp dir of every embedded cluster: the mark of ours
# Set before Ray is imported anywhere in this process: Ray reads them at import and start-up.
_LOCAL_ENV = {
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",  # makes Ray pick the loopback address as the node IP
    "RAY_USAGE_STATS_ENABLED": "0",
    # With stats off, Ray's dashboard still posts a "usage stats disabled" notice to usage-stats.ray.io
    # for clusters not started by ray.init(); send it to the discard port on loopback instead.
    "RAY_USAGE_STATS_REPORT_URL": "http://127.0.0.1:9/",
    # No idle default workers started ahead: every rank actor needs the job's runtime env, which such a worker
    # does not have, so they only cost each node a Python start (measured: two of ~0.4 CPU-s each per cluster).
    "RAY_prestart_worker_first_driver": "0",
}
# The proxy variables pointed at the discard port on loopback: Ray's head node starts a dashboard process even
# without the dashboard (its usage-stats module), and that asks the cloud-metadata address 169.254.169.254 and
# metadata.google.internal which cloud it runs on, usage stats off or not (strace of a launch). The embedded
# cluster's head node starts with them (``local_cluster``); the ranks get the user's own back (``PROXY_VARS``,
# launch.ray.runtime_env: their code may download).
_HEAD_NODE_ENV = {"http_proxy": "http://127.0.0.1:9", "HTTP_PROXY": "http://127.0.0.1:9",
                  "no_proxy": "127.0.0.1,localhost,::1", "NO_PROXY": "127.0.0.1,localhost,::1"}
PROXY_VARS = ("http_proxy", "HTTP_PROXY", "https_proxy", "HTTPS_PROXY", "no_proxy", "NO_PROXY")
# What a process that starts Ray on this machine needs in its environment before it does, so that no Ray process
# sends a packet off it: for scripts and tests that start Ray themselves.
LOOPBACK_ONLY_ENV = {**_LOCAL_ENV, **_HEAD_NODE_ENV}
# An embedded node needs little shared memory: only metrics and small results travel through it.
_OBJECT_STORE_BYTES = 100 * 1024 * 1024
REFUSED_GRACE_S = 3.0  # how long a refused connection is retried before the address counts as dead
CLIENT_RETRY_S = 2.0  # pause before Ray Client's join is tried again after its server failed to start
_NO_CLUSTER_FIX = "start one with `ray start --head` (and `ray start --address=...` on the other nodes), or use " \
                  "address: local"


@dataclass(frozen=True)
class Connected:
    address: str
    nodes: int  # live Ray nodes

    def line(self) -> str:
        return f"connected to Ray at {self.address}: {self.nodes} node{'s' if self.nodes != 1 else ''}"


def node_resource(index: int) -> str:
    """The custom resource that marks embedded Ray node ``index``."""
    return f"hybrid_node_{index}"


def local_env() -> dict:
    """Environment the embedded cluster needs; applied to this process before Ray starts."""
    return dict(_LOCAL_ENV)


@contextlib.contextmanager
def connect(spec: ClusterSpec, keep_logs: Optional[Path] = None,
            client_runtime_env: Optional[dict] = None) -> Iterator[Connected]:
    """Connect to (or start) the Ray cluster of ``spec``; tear down on every way out of the block. An embedded
    cluster's session logs (every rank's stdout/stderr) are moved to ``keep_logs`` at teardown. Through Ray
    Client (``ray://``) a local working directory can only be shipped as the job's ``runtime_env`` at
    connect time: ``client_runtime_env``."""
    if spec.is_local:
        check_embedded(spec.nodes, spec.gpus_per_node)
        with local_cluster(spec.nodes, spec.gpus_per_node, keep_logs) as cluster:
            yield Connected(cluster.address, _live_nodes())
    else:
        env = client_runtime_env if spec.address.startswith("ray://") else None
        with remote_cluster(spec.address, spec.connect_timeout_s, env) as connected:
            yield connected


@contextlib.contextmanager
def local_cluster(nodes: int, ranks_per_node: int, keep_logs: Optional[Path] = None) -> Iterator[object]:
    """Start an embedded Ray cluster of ``nodes`` nodes on 127.0.0.1 and connect the driver to it. Its temp
    directory goes at teardown; its session logs are moved to ``keep_logs`` first when given."""
    os.environ.update(_LOCAL_ENV)  # for every Ray process started below, which inherit it
    # The nodes run in sessions of their own (``_own_sessions``): a terminal's hangup reaches the launcher
    # alone, so it is an interrupt too, unless ignored (``nohup``); else the launcher died of it at once and
    # left the raylets' agents orphaned.
    ours = signals.with_hangup()
    with signals.as_interrupt(*ours):
        import ray
        from ray._private import ray_constants
        from ray.cluster_utils import Cluster

        # Ray reads RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER once, at import; when this process imported Ray before
        # the variable was set, the driver would look itself up at its non-loopback address. Pin it here.
        enable_cluster = ray_constants.ENABLE_RAY_CLUSTER
        ray_constants.ENABLE_RAY_CLUSTER = False
        base = tempfile.mkdtemp(prefix=EMBEDDED_PREFIX, dir=_short_tmp())
        previous_tmpdir = os.environ.get("RAY_TMPDIR")
        cluster = reaper = None
        try:
            reaper = Reaper.start(base, keep_logs)  # cleans up in our place should this process be SIGKILLed
            os.environ["RAY_TMPDIR"] = base
            log.info("starting embedded Ray: %d nodes x %d CPUs on %s", nodes, ranks_per_node, LOOPBACK)
            try:
                cluster = Cluster(initialize_head=False)
                with _own_sessions():
                    for i in range(nodes):
                        with _environment(_HEAD_NODE_ENV if i == 0 else {}):
                            cluster.add_node(**_node_args(i, ranks_per_node, head=i == 0))
                        signals.take_back(*ours)  # each node's start installed a SIGTERM handler of Ray's own
                cluster.wait_for_nodes()
                _watch_gcs(cluster)
                ray.init(address=cluster.address, log_to_driver=True, logging_level=logging.WARNING)
            except SystemExit as exit_:  # Ray's SIGTERM handler (a node's, ray.init's) exits rather than raise
                raise KeyboardInterrupt("SIGTERM while the embedded cluster started") from exit_
            with signals.as_interrupt(*ours):  # again: ray.init installed a SIGTERM handler of its own
                yield cluster
        finally:
            with signals.ignored(*ours):  # a second Ctrl-C must not cut the teardown short
                _shutdown(ray, cluster, ours)
                _watch_gcs(None)
                clean_up(base, keep_logs)
                if reaper is not None:
                    reaper.release()
                _restore_env("RAY_TMPDIR", previous_tmpdir)
                ray_constants.ENABLE_RAY_CLUSTER = enable_cluster


@contextlib.contextmanager
def remote_cluster(address: str, timeout_s: float = 60.0, runtime_env: Optional[dict] = None) -> Iterator[Connected]:
    """Attach to a running Ray cluster (``auto`` or ``ray://host:port``) within ``timeout_s``; start
    nothing."""
    with signals.as_interrupt():
        deadline = time.monotonic() + timeout_s
        target = resolve_address(address)
        host, port = split_host_port(target)
        probe_tcp(address, host, port, timeout_s)
        import ray

        auth_mode = os.environ.get("RAY_AUTH_MODE")
        _token_auth_as_ray_start_does()
        connected = False
        try:
            _init_within(ray, address, target, max(0.5, deadline - time.monotonic()), timeout_s, runtime_env)
            connected = True
            yield Connected(target, _live_nodes())
        finally:
            if connected:
                ray.shutdown()
                signals.reassert()
            _restore_auth_mode(auth_mode)


def _token_auth_as_ray_start_does() -> None:
    """Ray (2.5x on) turns token authentication on for a ``ray start`` cluster wherever a token is found
    (``RAY_AUTH_TOKEN``, ``RAY_AUTH_TOKEN_PATH``, ``~/.ray/auth_token``: one plain ``ray.init()`` writes it),
    but a client sends its token only in token mode: without this, joining such a cluster timed out. A client
    in token mode joins a cluster without authentication too (checked with Ray 2.60). ``RAY_AUTH_MODE`` set
    by the user wins; the launcher puts the variable back after the connection."""
    try:
        from ray._private.authentication import authentication_token_setup as setup
    except ImportError:  # a Ray without token authentication
        return
    quiet = logging.getLogger(setup.__name__)  # its "token authentication is enabled" is about clusters it starts
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        setup.maybe_enable_token_auth_if_token_available(warn_if_disabled=False)
    except (AttributeError, TypeError):  # a private API of another shape: Ray's default then
        pass
    finally:
        quiet.setLevel(level)


def _restore_auth_mode(value: Optional[str]) -> None:
    """``RAY_AUTH_MODE`` as it was, and Ray's cached config re-read from it (token mode switched it)."""
    if os.environ.get("RAY_AUTH_MODE") == value:
        return
    _restore_env("RAY_AUTH_MODE", value)
    try:
        from ray._raylet import Config

        Config.initialize("")
    except (ImportError, AttributeError, TypeError):
        pass


def resolve_address(address: str) -> str:
    """The concrete address ``address`` stands for: ``ray://…`` as given; ``auto`` as ``RAY_ADDRESS`` or the
    cluster ``ray start`` recorded, refusing an embedded cluster of another ``hybrid`` process."""
    if address != "auto":
        return address
    env = os.environ.get("RAY_ADDRESS", "").strip()
    if env and env != "auto":
        return env
    recorded = recorded_address()
    if recorded is None:
        raise ConfigError(f"cluster.address is 'auto', but RAY_ADDRESS is not set and no Ray cluster was started "
                          f"on this machine with `ray start`; {_NO_CLUSTER_FIX}.")
    if is_embedded(recorded):
        raise ConfigError(f"cluster.address is 'auto', but the only Ray cluster recorded here ({recorded}) is an "
                          f"embedded one of another hybrid process, which it must not join; {_NO_CLUSTER_FIX}.")
    return recorded


def recorded_address(env: Optional[Mapping[str, str]] = None) -> Optional[str]:
    """What ``ray start`` wrote to ``<tmp>/ray/ray_current_cluster`` (Ray's own lookup for ``auto``), with
    ``<tmp>`` from ``env`` (default: this process's environment) as Ray picks it."""
    env = os.environ if env is None else env
    tmp = env.get("RAY_TMPDIR") or env.get("TMPDIR") or "/tmp"
    try:
        text = (Path(tmp) / "ray" / "ray_current_cluster").read_text().strip()
    except OSError:
        return None
    return text or None


def is_embedded(address: str, proc: Path = Path("/proc")) -> bool:
    """Whether a process serving the GCS at ``address`` belongs to an embedded ``hybrid`` cluster: its
    command line names our temp dir or our node resource."""
    try:
        _, port = split_host_port(address)
    except ConfigError:
        return False
    needles = (f"--gcs_server_port={port}", f"--gcs-address={address}", f"--gcs_address={address}")
    for _, cmdline in processes(proc):
        if any(n in cmdline for n in needles) and (EMBEDDED_PREFIX in cmdline or "hybrid_node_" in cmdline):
            return True
    return False


def split_host_port(address: str) -> tuple[str, int]:
    rest = address.split("://", 1)[-1]
    host, _, port = rest.rpartition(":")
    if not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ConfigError(f"cluster.address resolves to {quote(address)}, which is not host:port; set RAY_ADDRESS "
                          "or cluster.address to host:port of the Ray head.")
    return host.strip("[]"), int(port)


def probe_tcp(address: str, host: str, port: int, timeout_s: float) -> None:
    """Raise ``ConfigError`` unless something accepts a TCP connection at ``host:port`` within ``timeout_s``."""
    start = time.monotonic()
    deadline = start + timeout_s
    last: Optional[OSError] = None
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((host, port), timeout=min(5.0, max(0.1, deadline - time.monotonic()))):
                return
        except ConnectionRefusedError as err:  # a head still starting refuses briefly; a dead one for good
            last = err
            if time.monotonic() - start > REFUSED_GRACE_S:
                break
        except OSError as err:
            last = err
        time.sleep(min(0.5, max(0.0, deadline - time.monotonic())))
    reason = (last.strerror or str(last)) if last else "no answer"
    raise ConfigError(f"cluster.address is {quote(address)}, but no Ray cluster answered at {host}:{port} within "
                      f"cluster.connect_timeout_s = {timeout_s:g} s ({reason}); {_NO_CLUSTER_FIX}.")


def _init_within(ray, address: str, target: str, wait_s: float, timeout_s: float,
                 runtime_env: Optional[dict] = None) -> None:
    """``ray.init(target)`` in a helper thread, so a cluster that accepts connections but never answers
    cannot hang the driver past ``wait_s``; Ctrl-C stays live meanwhile."""
    deadline = time.monotonic() + wait_s

    def init():
        while True:
            try:
                ray.init(address=target, logging_level=logging.WARNING, runtime_env=runtime_env)
                return
            except BaseException as err:  # noqa: BLE001 - within() hands it to the main thread
                if _server_not_ready(err) and time.monotonic() + CLIENT_RETRY_S < deadline:
                    with contextlib.suppress(Exception):
                        ray.shutdown()
                    time.sleep(CLIENT_RETRY_S)
                    continue
                raise

    quiet = _DropMessage("SIGTERM handler is not set")  # we handle SIGTERM ourselves
    logging.getLogger("ray._private.worker").addFilter(quiet)
    try:
        joined = within(init, wait_s, name="ray-connect")
    except KeyboardInterrupt:  # Ctrl-C or SIGTERM on this (the main) thread while waiting
        raise
    except BaseException as err:  # noqa: BLE001 - every failure of ray.init to join is one sentence
        error = err
    else:
        if joined:
            return
        raise ConfigError(f"cluster.address is {quote(address)}: the Ray cluster at {target} accepted the connection "
                          f"but did not let the driver join within cluster.connect_timeout_s = {timeout_s:g} s; "
                          "check that it is healthy (`ray status`) or raise cluster.connect_timeout_s.")
    finally:
        logging.getLogger("ray._private.worker").removeFilter(quiet)
    first = first_line(error, type(error).__name__)
    raise ConfigError(f"cluster.address is {quote(address)}, but joining the Ray cluster at {target} failed "
                      f"({quote(first)[1:-1]}); {_NO_CLUSTER_FIX}.")


def _server_not_ready(err: BaseException) -> bool:
    """Ray Client's proxy could not start this driver's server in time (a loaded head): worth another try."""
    return "Initialization failure from server" in str(err)


class _DropMessage(logging.Filter):
    def __init__(self, text: str):
        super().__init__()
        self.text = text

    def filter(self, record: logging.LogRecord) -> bool:
        return self.text not in record.getMessage()


def _live_nodes() -> int:
    from launch.ray.probe import live_nodes  # imports Ray

    return len(live_nodes())


def _node_args(index: int, ranks_per_node: int, head: bool) -> dict:
    args = dict(num_cpus=ranks_per_node, num_gpus=0, resources={node_resource(index): 1},
                node_ip_address=LOOPBACK, object_store_memory=_OBJECT_STORE_BYTES)
    if head:
        args.update(include_dashboard=False)
    return args


@contextlib.contextmanager
def _own_sessions() -> Iterator[None]:
    """Inside the block every Ray process this driver starts (GCS, raylet, log monitor; the raylet's
    workers and agents follow their raylet) gets a session, and so a process group, of its own.

    A signal to the launcher's process group -- a terminal's Ctrl-C, GNU ``timeout``, ``kill -- -PGID`` --
    then reaches the launcher alone, which stops the nodes itself by pid (``_shutdown``, ``clean_up``).
    Left in the launcher's group, a group SIGTERM killed the GCS and the raylets at the same instant as it
    interrupted the launcher, whose teardown then waited on the dead GCS until Ray's 60 s reconnect timeout
    aborted it (exit 1, no teardown, temp dirs and logs left). SIGINT never hit this only because Ray
    blocks it in its children. A session rather than just a group: no job control of the terminal (hangup,
    SIGTTOU on output) applies to them either.

    Only where the kernel kills Ray's processes when their parent dies (``PR_SET_PDEATHSIG``, Linux),
    as Ray itself decides on Windows: without it Ray's reaper cleans up by the launcher's process group,
    which its processes must then share. A Ray whose private start-up API has another shape keeps its own
    behaviour.

    Why here and not in the teardown (skipping Ray's calls once the GCS is found dead): the call that
    waits is not the cluster's teardown but the job's (the worker group's placement-group removal, a GCS
    request), and with the GCS gone Ray's core worker aborts the whole process after its 60 s reconnect
    timeout whatever the launcher does meanwhile. Kept out of the signal, the cluster stays whole until
    the launcher has stopped its ranks and nodes in order. A kill of every process of a control group
    (systemd's ``KillMode=control-group``, Slurm's) still reaches the nodes directly: then ``gcs_lost``
    makes the teardown skip its GCS calls, so that it ends before that timeout."""
    try:
        from ray._private import services
        from ray._private.utils import detect_fate_sharing_support

        popen = services.ConsolePopen
        own = sys.platform.startswith("linux") and bool(detect_fate_sharing_support())
    except (ImportError, AttributeError):
        own = False
    if not own:
        yield
        return

    class OwnSessionPopen(popen):
        def __init__(self, *args, **kwargs):
            kwargs.setdefault("start_new_session", True)
            super().__init__(*args, **kwargs)

    services.ConsolePopen = OwnSessionPopen
    try:
        yield
    finally:
        services.ConsolePopen = popen


_gcs_pid: Optional[int] = None  # the GCS server of this process's embedded cluster, while it runs


def _watch_gcs(cluster) -> None:
    """Remember the pid of ``cluster``'s GCS server (None: forget it), for ``gcs_lost``."""
    global _gcs_pid
    _gcs_pid = None
    head = getattr(cluster, "head_node", None)
    try:
        from ray._private import ray_constants

        _gcs_pid = head.all_processes[ray_constants.PROCESS_TYPE_GCS_SERVER][0].process.pid
    except (AttributeError, KeyError, IndexError, ImportError):
        pass  # no cluster, or a Ray whose private layout differs: never reported lost


def gcs_lost() -> bool:
    """Whether this process's embedded cluster lost its GCS server: a kill of every process of the job at
    once (systemd's ``KillMode=control-group``, Slurm's ``scancel``) reaches the cluster's processes directly.
    Then a synchronous Ray call that needs the GCS (removing a placement group) waits until Ray's 60 s
    reconnect timeout aborts the whole process; a teardown skips those calls instead (``within``), and stops
    the nodes by pid. False on a cluster this process did not start."""
    return _gcs_pid is not None and not alive(_gcs_pid)


def within(call, timeout_s: float, name: str = "ray-call", poll_s: float = 0.1) -> bool:
    """Run ``call()`` in a daemon helper thread named ``name`` and wait until it returns, ``timeout_s`` passes,
    or this process's embedded cluster loses its GCS (``gcs_lost``): True when it returned; what it raised
    is raised here. For Ray calls with no timeout of their own: joining a cluster that accepts connections
    but never answers, or removing a placement group while the GCS is being killed (it stops answering
    before its process is gone). Ctrl-C stays live meanwhile."""
    done = threading.Event()
    failure: list = []

    def run():
        try:
            call()
        except BaseException as err:  # noqa: BLE001 - handed to the caller's thread
            failure.append(err)
        finally:
            done.set()

    threading.Thread(target=run, name=name, daemon=True).start()
    deadline = time.monotonic() + timeout_s
    while not done.wait(poll_s):
        if gcs_lost() or time.monotonic() >= deadline:
            return False
    if failure:
        raise failure[0]
    return True


def _shutdown(ray, cluster, ignoring=signals.BOTH) -> None:
    # Never let a failing teardown hide the error that brought us here, and never skip killing the nodes.
    try:
        ray.shutdown()  # with the GCS gone it gives up after ~5 s
    except Exception:  # pragma: no cover - best effort
        log.exception("ray.shutdown failed")
    signals.reassert(*ignoring)  # the teardown's ignore is back before the nodes are stopped
    if cluster is not None:
        try:
            cluster.shutdown()
        except Exception:  # pragma: no cover - best effort
            log.exception("stopping the embedded Ray cluster failed")


def _short_tmp() -> str:
    """The system temp dir, or /tmp where that is so long that Ray's socket paths below it would not fit
    the 107 bytes of an AF_UNIX address."""
    tmp = tempfile.gettempdir()
    return tmp if len(tmp) <= 24 or not os.path.isdir("/tmp") else "/tmp"


@contextlib.contextmanager
def _environment(values: dict) -> Iterator[None]:
    """``values`` in ``os.environ`` for the block (the processes it starts inherit them), then as before."""
    previous = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in previous.items():
            _restore_env(name, value)


def _restore_env(name: str, value: Optional[str]) -> None:
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value
