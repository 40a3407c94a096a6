"""One embedded Ray cluster (2 nodes x 2 CPUs, loopback only) for every in-process launch test of this package.

Starting a cluster costs seconds on a 2-core machine; the launch tests' modules (test_launch_ray,
test_levers_ray, test_replan_ray) share this one, which is torn down after the
package's last test. Every process below this driver is watched for non-loopback peers while it runs, and
none may be left after the teardown. The CLI tests start their own clusters in subprocesses, as users do.
"""

import os
import signal

import pytest

from launch.ray import cluster as ray_cluster
from tests.launch.netcheck import LoopbackAudit, NetWatch, session_processes

NODES, RANKS_PER_NODE = 2, 2
# Whether this test process started with SIGHUP ignored (under nohup): the launcher then leaves it ignored.
HANGUP_IGNORED_AT_START = signal.getsignal(signal.SIGHUP) == signal.SIG_IGN


@pytest.fixture(scope="package")
def cluster():
    audit = LoopbackAudit.install()
    watch = NetWatch(os.getpid()).start()
    audit.active = True
    try:
        with ray_cluster.local_cluster(NODES, RANKS_PER_NODE):
            yield watch, audit
    finally:
        audit.active = False
        watch.stop()
    assert len(watch.seen) >= 10, "the watcher saw too few Ray processes to mean anything"
    assert watch.wait_survivors() == [], "Ray processes left after teardown"
    assert session_processes(os.getpid()) == []
