"""How `make test` shares the suite between two pytest-xdist workers.

Units of work are test files, except that the files whose tests share the package's embedded Ray cluster
(``tests/launch/conftest.py``'s ``cluster`` fixture) form one unit, so that one worker starts that cluster
once. Units go out longest first, by tier, so that the short unit-test files fill the gaps at the end:
the shared-cluster unit, then the other launch files (each starts its own clusters), then the gloo worlds of
``tests/dist``, then ``tests/gpu`` (skipped without a GPU) and ``tests/unit``.

(xdist's own ``--dist loadgroup`` would say this with marks, but under pytest 9 it no longer groups: it tags
``item._nodeid``, which pytest 9 does not read. This scheduler needs nothing from the items but their ids.)
"""

from __future__ import annotations

from collections import OrderedDict

from xdist.scheduler import LoadScopeScheduling

SHARED_CLUSTER_FILES = frozenset(f"tests/launch/{name}.py" for name in (
    "test_launch_ray", "test_levers_ray", "test_probe_ray", "test_replan_ray", "test_tp_plan_ray"))
SHARED_CLUSTER_UNIT = "tests/launch[shared cluster]"
TIER_ORDER = (SHARED_CLUSTER_UNIT, "tests/launch/", "tests/dist/", "tests/gpu/", "tests/unit/")


def unit_of(nodeid: str) -> str:
    """The unit of work a test belongs to: its file, or the shared-cluster unit."""
    path = nodeid.split("::", 1)[0]
    return SHARED_CLUSTER_UNIT if path in SHARED_CLUSTER_FILES else path


def tier(unit: str) -> int:
    """Where ``unit`` goes in the queue: the index of the first ``TIER_ORDER`` entry it starts with."""
    return next((i for i, prefix in enumerate(TIER_ORDER) if unit.startswith(prefix)), len(TIER_ORDER))


class SuiteScheduling(LoadScopeScheduling):
    """xdist's scope scheduling with ``unit_of`` as the scope and the queue in ``tier`` order."""

    def _split_scope(self, nodeid: str) -> str:
        return unit_of(nodeid)

    def schedule(self) -> None:
        if self.collection is None and self.collection_is_completed:
            self._order_queue_by_tier()
        super().schedule()

    def _order_queue_by_tier(self) -> None:
        """Put the units in the queue in tier order. The base class then sets each unit's tests by key, which
        leaves an ordered dict's existing keys where they are."""
        collection = next(iter(self.registered_collections.values()), [])
        units = OrderedDict((unit_of(nodeid), None) for nodeid in collection)
        for unit in sorted(units, key=tier):
            self.workqueue[unit] = {}
