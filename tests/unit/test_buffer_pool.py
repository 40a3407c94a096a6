"""BufferPool: reuse by (dtype, device, numel), the cap over in-use plus kept, zero-filled new buffers."""

import torch

from hybrid.comm.buffer_pool import BufferPool


def test_a_given_back_buffer_is_handed_out_again_for_the_same_shape_only():
    pool = BufferPool(100)
    a = pool.take(10, torch.float32, "cpu")
    pool.give(a)
    assert pool.take(10, torch.float32, "cpu") is a
    assert pool.take(10, torch.bfloat16, "cpu") is not a
    pool.give(a)
    b = pool.take(11, torch.float32, "cpu")
    assert b is not a and b.numel() == 11
    assert pool.kept() == [a]


def test_the_cap_counts_buffers_in_use_with_the_kept_ones():
    pool = BufferPool(20)
    a, b, c = (pool.take(8, torch.float32, "cpu") for _ in range(3))
    assert pool.in_use_numel == 24
    assert not pool.may_take(1)
    pool.give(a)            # 16 in use + 8 kept > 20: dropped
    assert pool.kept() == []
    pool.give(b)            # 8 in use + 8 kept <= 20: kept
    pool.give(c)            # 0 in use + 16 kept <= 20: kept
    assert pool.in_use_numel == 0 and len(pool.kept()) == 2
    assert pool.may_take(1000)  # nothing in use: a call may always start


def test_keep_false_and_clear_drop_buffers():
    pool = BufferPool(100)
    a = pool.take(4, torch.float32, "cpu")
    pool.give(a, keep=False)
    assert pool.kept() == [] and pool.in_use_numel == 0
    pool.give(pool.take(4, torch.float32, "cpu"))
    pool.clear()
    assert pool.kept() == []


def test_new_buffers_are_zeroed_when_asked_and_kept_ones_hold_their_contents():
    pool = BufferPool(100)
    a = pool.take(6, torch.float32, "cpu", zeroed=True)
    assert torch.equal(a, torch.zeros(6))
    a.fill_(3.0)
    pool.give(a)
    again = pool.take(6, torch.float32, "cpu", zeroed=True)
    assert again is a and torch.equal(again, torch.full((6,), 3.0))
