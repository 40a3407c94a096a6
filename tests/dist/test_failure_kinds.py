"""A real gloo world's collectives failing because of a peer are ``FailureKind.PEER`` on the rank that sees them
(``hybrid.runtime.failure.failure_kind``): a peer whose process exits (gloo's closed connection, sync and on
an async handle's ``wait()``, and the shared-memory path's own error), and a peer that never comes within the
group's timeout. The kinds' other cases are tests/unit/test_failure_kinds.py's."""

import json
import os
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from hybrid.runtime.local_launch import LocalRunError, run_local

pytestmark = pytest.mark.slow


def _kinds(calls: dict) -> dict:
    """``name -> (kind, first line of the error)`` of each call, which must raise."""
    from hybrid.runtime.failure import failure_kind

    seen = {}
    for name, call in calls.items():
        try:
            call()
            seen[name] = ("nothing raised", "")
        except Exception as err:  # noqa: BLE001 -- what the rank actor would catch
            seen[name] = (failure_kind(err).value, str(err).splitlines()[0])
    return seen


def _peer_exits(path: str):
    import hybrid.comm.collectives as collectives
    from hybrid.comm.collectives import Comm

    comm = Comm(name="world")
    big = collectives.SHM_MIN_BYTES // 4  # elements of an all-reduce that goes through shared memory
    comm.all_reduce(torch.ones(big))  # the shared-memory transport connects
    comm.all_reduce(torch.ones(4))
    if comm.rank == 1:
        os._exit(3)
    seen = _kinds({"gloo": lambda: comm.all_reduce(torch.ones(4)),
                   "gloo async": lambda: comm.all_reduce(torch.ones(4), async_op=True).wait(),
                   "shared memory": lambda: comm.all_reduce(torch.ones(big))})
    with open(path, "w") as f:
        json.dump(seen, f)
    raise RuntimeError("rank 0 saw its peer exit")  # rank 1 never reports: end the run here


def test_collectives_whose_peer_exited_are_peer_failures(tmp_path):
    path = tmp_path / "kinds.json"
    with pytest.raises(LocalRunError, match="rank 0 saw its peer exit"):
        run_local(_peer_exits, 2, str(path), timeout_s=60)
    seen = json.loads(path.read_text())
    assert {name: kind for name, (kind, _) in seen.items()} == {
        "gloo": "peer", "gloo async": "peer", "shared memory": "peer"}, seen
    assert "exited during a collective" in seen["shared memory"][1]


def _peer_late():
    from hybrid.comm.collectives import Comm

    group = dist.new_group([0, 1], timeout=timedelta(seconds=1))  # the world keeps its own timeout
    comm = Comm(group, name="late")
    comm.all_reduce(torch.ones(4))
    if comm.rank == 1:
        time.sleep(3)  # past rank 0's timeout; it then calls nothing on the group
        return {}
    return _kinds({"sync": lambda: comm.all_reduce(torch.ones(4)),
                   "async": lambda: comm.all_reduce(torch.ones(4), async_op=True).wait()})


def test_a_collective_whose_peer_never_came_is_a_peer_failure():
    seen = run_local(_peer_late, 2, timeout_s=60)[0]
    assert {name: kind for name, (kind, _) in seen.items()} == {"sync": "peer", "async": "peer"}, seen
