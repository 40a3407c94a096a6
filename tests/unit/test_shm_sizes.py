"""hybrid.comm.shm' pure parts: region sizes, the memory model's resident bytes, the switch."""

import pytest

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


@pytest.mark.parametrize("value,on", [("0", False), ("false", False), ("OFF", False), (" no ", False),
                                      ("1", True), ("true", True), ("", True)])
def test_the_switch(monkeypatch, value, on):
    monkeypatch.setenv(shm.ENV_SWITCH, value)
    assert shm._enabled() is on
