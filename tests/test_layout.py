"""Pure-Python layer: owner assignment and the flat buffer layout, no process group."""

import pytest

from zerofast.layout import ALIGN, build_layout
from zerofast.partition import greedy, imbalance, owners_for, round_robin

NUMELS = [1024, 256, 16, 768, 16, 7, 4096, 64, 1, 300]


def test_round_robin_owners_are_i_mod_world():
    assert round_robin([5] * 7, 3) == [0, 1, 2, 0, 1, 2, 0]


def test_greedy_largest_first_to_least_loaded():
    owners = greedy([10, 1, 7, 3, 3], 2)
    # 10 -> 0; 7 -> 1; 3 -> 1 (7 < 10); 3 -> 0 (10 == 10, lower rank); 1 -> 1 (10+3 vs 7+3... 13 > 10)
    assert owners == [0, 1, 1, 1, 0]
    loads = [sum(n for n, o in zip([10, 1, 7, 3, 3], owners) if o == r) for r in range(2)]
    assert loads == [13, 11]


def test_greedy_beats_round_robin_on_skewed_sizes():
    numels = [1000, 10, 10, 10, 1000, 10, 10, 10]

    def load(owners):
        return [sum(n for n, o in zip(numels, owners) if o == r) for r in range(4)]

    assert imbalance(load(greedy(numels, 4))) < imbalance(load(round_robin(numels, 4)))


def test_unknown_partition_is_named():
    with pytest.raises(ValueError, match="partition must be one of flat, round_robin, greedy; got 'zigzag'"):
        owners_for("zigzag", [1], 2)


def _covered(layout, world):
    """Every element of every parameter is owned by exactly one rank."""
    seen = {i: [0] * n for i, n in enumerate(NUMELS)}
    for r in range(world):
        for pc in layout.pieces(r):
            for k in range(pc.param_offset, pc.param_offset + pc.numel):
                seen[pc.param][k] += 1
    return all(c == 1 for counts in seen.values() for c in counts)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("cap", [10_000, 1500, 100])
def test_flat_layout(world, cap):
    order = list(reversed(range(len(NUMELS))))
    layout = build_layout(NUMELS, order, world, cap)
    assert layout.flat
    assert _covered(layout, world)
    for b in layout.buckets:
        assert b.numel % (world * ALIGN) == 0, "padded to world * ALIGN: see [Note: padding]"
        widths = {b.bounds[r + 1] - b.bounds[r] for r in range(world)}
        assert len(widths) == 1, "equal slices for reduce_scatter / all_gather"
        assert layout.used_numel(b.index) <= b.numel < layout.used_numel(b.index) + world * ALIGN
        assert layout.used_numel(b.index) <= cap or len(b.params) == 1, (
            "only a lone oversized parameter may exceed the cap"
        )
    # Buckets follow the given (backward) order.
    flat_order = [i for b in layout.buckets for i in b.params]
    assert flat_order == order
    assert sum(layout.owned_numel(r) for r in range(world)) == sum(NUMELS)
    assert all(layout.shard_numel(r) == sum(b.numel for b in layout.buckets) // world for r in range(world))


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("partition", ["round_robin", "greedy"])
def test_owner_layout(world, partition):
    owners = owners_for(partition, NUMELS, world)
    layout = build_layout(NUMELS, list(range(len(NUMELS)))[::-1], world, 1500, owners)
    assert not layout.flat
    assert _covered(layout, world)
    for r in range(world):
        # A rank owns exactly its parameters, whole.
        assert layout.owned_numel(r) == sum(n for n, o in zip(NUMELS, owners) if o == r)
        assert {pc.param for pc in layout.pieces(r)} == {i for i, o in enumerate(owners) if o == r}
    for b in layout.buckets:
        assert b.numel == layout.used_numel(b.index), "owner layouts need no padding"
        for i in b.params:  # each owner's parameters form one segment
            s = layout.slots[i]
            assert b.bounds[owners[i]] <= s.offset and s.offset + s.numel <= b.bounds[owners[i] + 1]


def test_pieces_offsets_line_up():
    layout = build_layout(NUMELS, list(range(len(NUMELS))), 3, 700)
    for r in range(3):
        offsets = layout.shard_offsets(r)
        for pc in layout.pieces(r):
            lo, _ = layout.owned_range(pc.bucket, r)
            assert pc.state_offset == offsets[pc.bucket] + pc.bucket_offset - lo
            s = layout.slots[pc.param]
            assert pc.bucket_offset == s.offset + pc.param_offset


def test_bad_layout_arguments():
    with pytest.raises(ValueError, match="permutation"):
        build_layout([1, 2], [0, 0], 2, 10)
    with pytest.raises(ValueError, match="bucket_numel must be positive; got 0"):
        build_layout([1, 2], [0, 1], 2, 0)
