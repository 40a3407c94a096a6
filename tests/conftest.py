"""Shared test settings: loopback-only networking for every process group and Ray cluster; under pytest-xdist,
the tests/launch tier in one worker."""

import os

import pytest

os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
for _k in ("http_proxy", "HTTP_PROXY"):
    os.environ.setdefault(_k, "http://127.0.0.1:9")
for _k in ("no_proxy", "NO_PROXY"):
    os.environ.setdefault(_k, "127.0.0.1,localhost,::1")


@pytest.hookimpl(optionalhook=True)  # a pytest-xdist hook: ignored where xdist is not installed
def pytest_xdist_make_scheduler(config, log):
    """Under pytest-xdist (``make test``: ``-n 2``) one worker runs every test of tests/launch, in order, while
    the other takes the rest one test at a time: the Ray tests share one embedded cluster
    (tests/launch/conftest.py) and start their clusters one after another, as in a serial run, and the
    stretches where they wait on Ray (start-up, teardown, the timeouts they provoke) overlap the other tiers'
    work instead of idling a core. (xdist's own ``--dist loadgroup`` cannot do this under pytest 9.)"""
    if config.getvalue("dist") != "load":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class LaunchTierInOneWorker(LoadScopeScheduling):
        # The largest scope goes first (xdist orders scopes by size), so the longest lane starts at once.
        def _split_scope(self, nodeid: str) -> str:
            return "tests/launch" if nodeid.startswith("tests/launch/") else nodeid

    return LaunchTierInOneWorker(config, log)
