"""`common.shard.needs`: what a worker needs of a bucket, merged, said compactly and located in the
compact payload; workers with equal needs share a need-set."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from common.shard.needs import ByteRanges, Needs, need_sets

ranges_lists = st.lists(st.tuples(st.integers(0, 5000), st.integers(0, 300)), max_size=60)


def _bytes(ranges: ByteRanges) -> set[int]:
    return {b for s, n in zip(ranges.starts, ranges.lengths, strict=True) for b in range(s, s + n)}


@settings(max_examples=200, deadline=None)
@given(ranges_lists)
def test_shard_ranges_merge_to_the_same_bytes_and_survive_their_wire_form(pairs) -> None:
    starts = np.array([s for s, _ in pairs], dtype=np.int64)
    lengths = np.array([n for _, n in pairs], dtype=np.int64)
    merged = ByteRanges.of(starts, lengths)
    assert _bytes(merged) == {b for s, n in pairs for b in range(s, s + n)}
    ends = merged.starts + merged.lengths
    assert np.all(merged.starts[1:] > ends[:-1])  # sorted, disjoint, not touching
    assert ByteRanges.decode(merged.encode()) == merged


def test_shard_a_row_parallel_slice_is_one_group() -> None:
    """TP rank 1 of 4 of a [4096, 8192] bf16 row-parallel weight: 4096 runs of 4 KiB, one
    group on the wire."""
    rows, row_bytes = 4096, 8192 * 2
    ranges = ByteRanges.of(np.arange(rows) * row_bytes + row_bytes // 4,
                           np.full(rows, row_bytes // 4))
    assert ranges.encode() == [row_bytes // 4, row_bytes // 4, row_bytes, rows]
    assert ranges.nbytes == rows * row_bytes // 4


def test_shard_runs_land_at_their_place_in_the_compact_payload() -> None:
    ranges = ByteRanges.of(np.array([100, 500, 1000]), np.array([50, 100, 10]))
    runs = np.array([100, 120, 500, 590, 1000]), np.array([20, 30, 10, 10, 10])
    assert ranges.compact(*runs, align=1).tolist() == [0, 20, 50, 140, 150]
    # each range starts 16-byte aligned: 50 -> 64, 100 -> 112
    assert ranges.compact(*runs).tolist() == [0, 20, 64, 154, 176]
    assert ranges.compact_bytes() == 176 + 10 and ranges.compact_bytes(align=1) == 160
    with pytest.raises(ValueError, match="not within one needed range"):
        ranges.compact(np.array([140]), np.array([20]))  # runs past its range


def test_shard_workers_with_equal_needs_form_one_need_set() -> None:
    tp0 = Needs({0: ByteRanges.of(np.array([0]), np.array([64])), 1: ByteRanges.of(
        np.array([0, 256]), np.array([128, 128]))})
    tp1 = Needs({0: ByteRanges.of(np.array([64]), np.array([64]))})
    again = Needs.from_json(tp0.to_json())
    assert again.digest == tp0.digest and again.buckets[1] == tp0.buckets[1]
    full = Needs({}, full=True)
    sets = need_sets({2: tp0, 3: tp1, 4: again, 5: tp1, 6: full})
    assert [ranks for ranks, _ in sets] == [[2, 4], [3, 5], [6]]
    assert sets[0][1].nbytes() == 64 + 256 and sets[2][1].full


def test_shard_needs_outside_the_plan_are_refused_saying_where() -> None:
    needs = Needs({1: ByteRanges.of(np.array([0, 900]), np.array([64, 200]))})
    assert needs.problem([4096, 1100]) is None
    assert needs.problem([4096, 1000]) == "bucket 1: bytes 0..1100 outside its 1000 bytes"
    assert needs.problem([4096]) == "bucket 1 is not in the plan (1 buckets)"
