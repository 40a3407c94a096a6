"""hybrid.comm.shm's pure parts: region sizes, the memory model's resident bytes; and the switch, on a group of
two threads of this process (real shared memory and doorbells, no process group)."""

import threading

import pytest
import torch

import hybrid.comm.shm as shm


@pytest.mark.parametrize("size", [2, 3, 4, 8])
def test_a_region_is_two_buffers_of_slots_within_slice_bytes(size):
    assert shm.slot_bytes(size) % 64 == 0
    assert shm.region_bytes(size) == 2 * (size - 1) * shm.slot_bytes(size) <= 2 * shm.SLICE_BYTES


def test_resident_bytes_count_touched_pages_only():
    assert shm.resident_bytes(2, 0) == 0
    page = 4096
    assert shm.resident_bytes(2, 2 * page) == 2 * page + 2 * page  # own two buffers + the peer's two, one page each
    full = shm.resident_bytes(2, 1 << 30)  # a slot is filled to its size at most
    assert full == 4 * shm.slot_bytes(2)
    assert shm.resident_bytes(4, 1 << 30) <= 2 * 3 * shm.slot_bytes(4) + 3 * 4 * shm.slot_bytes(4) + 18 * page


class TwoThreadGroup:
    """Two threads of this process as the two ranks of one gloo group: what ``ShmGroup.connect`` asks
    ``torch.distributed`` about its group, answered for the calling thread's rank (``all_gather_object`` through
    a barrier). The shared memory, the cookie check through ``/proc/<pid>/fd`` and the doorbells are real."""

    def __init__(self, monkeypatch):
        self.barrier, self.slots, self.local = threading.Barrier(2, timeout=30), [None, None], threading.local()
        dist = shm.dist
        monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
        monkeypatch.setattr(dist, "get_rank", lambda group=None: self.local.rank)
        monkeypatch.setattr(dist, "get_backend", lambda group=None: "gloo")
        monkeypatch.setattr(dist, "get_process_group_ranks", lambda group: [0, 1])
        monkeypatch.setattr(dist, "all_gather_object", self.all_gather_object)

    def all_gather_object(self, out, obj, group=None):
        self.slots[self.local.rank] = obj
        self.barrier.wait()
        out[:] = list(self.slots)
        self.barrier.wait()  # both read before either writes its next object

    def run(self, fn):
        """``fn(rank)`` on both ranks at once; their results."""
        results, errors = [None, None], []

        def rank_thread(rank):
            self.local.rank = rank
            try:
                results[rank] = fn(rank)
            except BaseException as err:  # noqa: BLE001 -- reported below
                errors.append(err)
                self.barrier.abort()

        threads = [threading.Thread(target=rank_thread, args=(r,), daemon=True) for r in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not errors and not any(t.is_alive() for t in threads), errors
        return results


def _connect_and_all_reduce(rank):
    group = shm.ShmGroup.connect(object())
    if group is None:
        return None
    x = torch.full((1000,), float(rank + 1))
    group.all_reduce(x)
    return x.unique().tolist()


@pytest.mark.parametrize("value,on", [(None, True), ("1", True), ("", True), ("true", True),
                                      ("0", False), ("false", False), ("OFF", False), (" no ", False)])
def test_the_switch(monkeypatch, value, on):
    """HYBRID_SHM_COLLECTIVES decides whether a group of ranks on this host gets its shared-memory transport
    (which then moves the data: the all-reduce's sum) or none (``None``: the group stays on gloo)."""
    if value is None:
        monkeypatch.delenv(shm.ENV_SWITCH, raising=False)
    else:
        monkeypatch.setenv(shm.ENV_SWITCH, value)
    got = TwoThreadGroup(monkeypatch).run(_connect_and_all_reduce)
    assert got == ([[3.0], [3.0]] if on else [None, None])
