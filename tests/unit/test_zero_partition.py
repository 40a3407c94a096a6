"""The flat layout (hybrid.plan.layout): every parameter element is owned by exactly one rank, shards are equal
and contiguous, padding is bounded, and buckets respect their size."""

from hypothesis import given, settings
from hypothesis import strategies as st

from hybrid.plan.layout import align_up, bucket_groups, build_layout


def _owner_map(layout, rank_count):
    """(param, element) -> owning rank, built from owned_pieces of every rank."""
    owner = {}
    for r in range(rank_count):
        shard_pos = 0
        for piece in layout.owned_pieces(r):
            assert piece.shard_pos >= shard_pos  # pieces come in shard-space order
            shard_pos = piece.shard_pos
            for e in range(piece.start, piece.end):
                assert (piece.param, e) not in owner
                owner[(piece.param, e)] = r
    return owner


@settings(max_examples=60, deadline=None)
@given(numels=st.lists(st.integers(0, 97), min_size=1, max_size=12), n=st.integers(1, 5),
       align=st.sampled_from([1, 4, 8]), bucket=st.integers(1, 200))
def test_layout_covers_every_element_once(numels, n, align, bucket):
    groups = bucket_groups(numels, list(reversed(range(len(numels)))), bucket, align)
    assert all(groups) and sorted(p for g in groups for p in g) == list(range(len(numels)))
    for g in groups:  # a group only exceeds the bucket when it is a single oversized parameter
        assert len(g) == 1 or sum(align_up(numels[p], align) for p in g) <= bucket
    layout = build_layout(numels, groups, n, align)
    owner = _owner_map(layout, n)
    assert len(owner) == sum(numels)
    for unit in layout.units:
        assert unit.numel % (n * align) == 0 and unit.shard_numel * n == unit.numel
        assert unit.numel - unit.param_numel < len(unit.slots) * align + n * align
        for slot in unit.slots:
            assert slot.offset % align == 0
        used = {slot.offset + e for slot in unit.slots for e in range(slot.numel)}
        padding = {e for lo, hi in unit.padding_ranges() for e in range(lo, hi)}
        assert padding == set(range(unit.numel)) - used  # padding_ranges: exactly the elements no slot holds
    assert layout.shard_numel * n == layout.full_numel
    for p, numel in enumerate(numels):
        for r in range(n):
            start, end, shard_pos = layout.owned_range(p, r)
            mine = [e for e in range(numel) if owner[(p, e)] == r]
            assert list(range(start, end)) == mine  # one contiguous range per param and rank


def test_straddling_parameter_and_positions():
    # one unit: params of 5 and 6 elements, align 1, 2 shards -> unit of 12 = 2 x 6; param 1 straddles.
    layout = build_layout([5, 6], [[0, 1]], n_shards=2, align=1)
    (unit,) = layout.units
    assert (unit.numel, unit.shard_numel) == (12, 6)
    assert layout.owned_range(1, 0) == (0, 1, 5)    # rank 0 owns element 0 of param 1 at shard position 5
    assert layout.owned_range(1, 1) == (1, 6, 0)
    assert layout.owned_range(0, 1) == (0, 0, 0)    # nothing of param 0 on rank 1
    pieces = layout.owned_pieces(1)
    assert [(p.param, p.start, p.end, p.unit_pos, p.shard_pos) for p in pieces] == [(1, 1, 6, 6, 0)]


def test_units_stack_in_both_spaces():
    layout = build_layout([10, 3, 7], [[2], [0, 1]], n_shards=2, align=4)
    a, b = layout.units
    assert (a.numel, a.full_offset, a.shard_offset) == (8, 0, 0)
    assert [s.offset for s in b.slots] == [0, 12] and (b.numel, b.full_offset, b.shard_offset) == (16, 8, 4)
    assert (layout.full_numel, layout.shard_numel, layout.param_numel) == (24, 12, 20)
