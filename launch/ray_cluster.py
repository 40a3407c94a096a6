"""Connect the driver to the Ray cluster a spec names, and always let go of it.

``connect(cluster_spec)`` is a context manager. ``address: local`` starts an embedded Ray cluster with one
Ray node per declared node (``ray.cluster_utils.Cluster``), every process bound to 127.0.0.1, no
dashboard, no usage stats; leaving the block (normally, on an error, on Ctrl-C or SIGTERM) shuts the
driver and every node down. ``auto`` and ``ray://…`` attach to a running cluster, start nothing and only
disconnect on exit.

Each embedded node ``i`` carries the custom resource ``hybrid_node_<i>`` and ``gpus_per_node`` logical
CPUs (one per rank, whatever the physical core count), so ranks and probes can be placed per node.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
from typing import Iterator

from hybrid.errors import ConfigError
from launch.spec import ClusterSpec

log = logging.getLogger(__name__)

LOOPBACK = "127.0.0.1"
# Set before Ray is imported anywhere in this process: Ray reads them at import and start-up.
_LOCAL_ENV = {
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",  # makes Ray pick the loopback address as the node IP
    "RAY_USAGE_STATS_ENABLED": "0",
    # With stats off, Ray's dashboard still posts a "usage stats disabled" notice to usage-stats.ray.io
    # for clusters not started by ray.init(); send it to the discard port on loopback instead.
    "RAY_USAGE_STATS_REPORT_URL": "http://127.0.0.1:9/",
}
# An embedded node needs little shared memory: only metrics and small results travel through it.
_OBJECT_STORE_BYTES = 100 * 1024 * 1024


def node_resource(index: int) -> str:
    """The custom resource that marks embedded Ray node ``index``."""
    return f"hybrid_node_{index}"


def local_env() -> dict:
    """Environment the embedded cluster needs; applied to this process before Ray starts."""
    return dict(_LOCAL_ENV)


@contextlib.contextmanager
def connect(spec: ClusterSpec) -> Iterator[None]:
    """Connect to (or start) the Ray cluster of ``spec``; tear down on every way out of the block."""
    if spec.is_local:
        with local_cluster(spec.nodes, spec.gpus_per_node):
            yield
    else:
        with remote_cluster(spec.address):
            yield


@contextlib.contextmanager
def local_cluster(nodes: int, ranks_per_node: int) -> Iterator[object]:
    """Start an embedded Ray cluster of ``nodes`` nodes on 127.0.0.1 and connect the driver to it."""
    os.environ.update(_LOCAL_ENV)  # for every Ray process started below, which inherit it
    import ray
    from ray._private import ray_constants
    from ray.cluster_utils import Cluster

    # Ray reads RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER once, at import; when this process imported Ray before
    # the variable was set, the driver would look itself up at its non-loopback address. Pin it here.
    enable_cluster = ray_constants.ENABLE_RAY_CLUSTER
    ray_constants.ENABLE_RAY_CLUSTER = False
    cluster = None
    with _signals_as_interrupt():
        try:
            log.info("starting embedded Ray: %d nodes x %d CPUs on %s", nodes, ranks_per_node, LOOPBACK)
            cluster = Cluster(initialize_head=True, head_node_args=_node_args(0, ranks_per_node, head=True))
            for i in range(1, nodes):
                cluster.add_node(**_node_args(i, ranks_per_node, head=False))
            cluster.wait_for_nodes()
            ray.init(address=cluster.address, log_to_driver=True, logging_level=logging.WARNING)
            with _signals_as_interrupt():  # again: starting Ray installed SIGTERM handlers of its own
                yield cluster
        finally:
            _shutdown(ray, cluster)
            ray_constants.ENABLE_RAY_CLUSTER = enable_cluster


@contextlib.contextmanager
def remote_cluster(address: str) -> Iterator[None]:
    """Attach to a running Ray cluster (``auto`` or ``ray://host:port``); start nothing."""
    import ray

    try:
        try:
            ray.init(address=address, logging_level=logging.WARNING)
        except (ConnectionError, RuntimeError, ValueError) as err:
            first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise ConfigError(f"cluster.address is {address!r}, but no Ray cluster answers there ({first}); "
                              "start one with `ray start --head` on every node, or use address: local.") from None
        with _signals_as_interrupt():
            yield
    finally:
        ray.shutdown()


def _node_args(index: int, ranks_per_node: int, head: bool) -> dict:
    args = dict(num_cpus=ranks_per_node, num_gpus=0, resources={node_resource(index): 1},
                node_ip_address=LOOPBACK, object_store_memory=_OBJECT_STORE_BYTES)
    if head:
        args.update(include_dashboard=False)
    return args


def _shutdown(ray, cluster) -> None:
    # Never let a failing teardown hide the error that brought us here, and never skip killing the nodes.
    try:
        ray.shutdown()
    except Exception:  # pragma: no cover - best effort
        log.exception("ray.shutdown failed")
    if cluster is not None:
        try:
            cluster.shutdown()
        except Exception:  # pragma: no cover - best effort
            log.exception("stopping the embedded Ray cluster failed")


@contextlib.contextmanager
def _signals_as_interrupt() -> Iterator[None]:
    """Inside the block, SIGTERM and SIGINT raise KeyboardInterrupt, so the ``finally`` teardown runs.

    SIGINT is set explicitly because a launcher started in the background of a non-interactive shell
    inherits it ignored, and then even ``kill -INT`` would leave the cluster running.
    """
    def handler(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    try:
        previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGTERM, signal.SIGINT)}
    except ValueError:  # not the main thread: leave signals alone
        yield
        return
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)
