"""What an engine worker needs of each bucket: byte ranges of the payload, said compactly.

A worker whose load map is learned reads only some bytes of each bucket (a TP rank's rows of
a row-parallel tensor, its block of a column-parallel one, whole tensors that stay on
`load_weights`). `ByteRanges` holds one bucket's needed ranges, merged; its wire form groups
equal-length ranges at a constant stride, so a row-parallel tensor is one group, not one
range per row. `Needs` maps buckets to ranges (with a digest); workers whose needs are equal
form one need-set (`need_sets`), which is what a bucket is sent to. Offsets count from the
bucket's first tensor, like the load map's runs. Plain numpy: both sides import it.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

import numpy as np

_I64 = np.int64
COMPACT_ALIGN = 16  # each needed range starts at a multiple of this in a compact payload


@dataclass(frozen=True, eq=False)
class ByteRanges:
    """Sorted, disjoint, non-touching ranges [start, start + length) of one bucket."""

    starts: np.ndarray
    lengths: np.ndarray

    @classmethod
    def of(cls, starts: np.ndarray, lengths: np.ndarray) -> ByteRanges:
        """The union of ranges given in any order (overlapping or touching ones merge)."""
        starts, lengths = np.asarray(starts, dtype=_I64), np.asarray(lengths, dtype=_I64)
        keep = lengths > 0
        starts, lengths = starts[keep], lengths[keep]
        if not len(starts):
            return cls(starts, lengths)
        order = np.argsort(starts, kind="stable")
        s, e = starts[order], starts[order] + lengths[order]
        reach = np.maximum.accumulate(e)
        first = np.flatnonzero(np.concatenate([[True], s[1:] > reach[:-1]]))
        ends = np.maximum.reduceat(e, first)
        return cls(s[first], ends - s[first])

    @property
    def nbytes(self) -> int:
        return int(self.lengths.sum())

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, ByteRanges) and np.array_equal(self.starts, other.starts)
                and np.array_equal(self.lengths, other.lengths))

    def encode(self) -> list[int]:
        """Flat groups (start, length, stride, count): ranges start + i * stride, i < count."""
        n = len(self.starts)
        if n == 0:
            return []
        gaps = np.diff(self.starts)
        same = self.lengths[1:] == self.lengths[:-1]
        # gap k continues gap k - 1's progression when both keep the length and the stride
        breaks = np.flatnonzero((gaps[1:] != gaps[:-1]) | (same[1:] != same[:-1])) + 1
        run_end = np.append(breaks, len(gaps))[np.searchsorted(breaks, np.arange(len(gaps)),
                                                               side="right")]
        out, i = [], 0
        while i < n:
            if i < n - 1 and same[i]:
                last = int(run_end[i])  # gaps i .. last - 1 share length and stride
                out += [int(self.starts[i]), int(self.lengths[i]), int(gaps[i]), last - i + 1]
                i = last + 1
            else:
                out += [int(self.starts[i]), int(self.lengths[i]), 0, 1]
                i += 1
        return out

    @classmethod
    def decode(cls, flat: list[int]) -> ByteRanges:
        groups = np.asarray(flat, dtype=_I64).reshape(-1, 4)
        if not len(groups):
            return cls(np.zeros(0, _I64), np.zeros(0, _I64))
        counts = groups[:, 3]
        index = np.arange(int(counts.sum()), dtype=_I64) - np.repeat(
            np.cumsum(counts) - counts, counts)
        starts = np.repeat(groups[:, 0], counts) + index * np.repeat(groups[:, 2], counts)
        return cls.of(starts, np.repeat(groups[:, 1], counts))

    def placed(self, align: int = COMPACT_ALIGN) -> np.ndarray:
        """Where each range begins in the compact payload: the ranges in order, each at the
        next multiple of `align` (so a range keeps its alignment for vectorised copies)."""
        ends = np.cumsum(-(-self.lengths // align) * align)
        return np.concatenate([[0], ends[:-1]]).astype(_I64) if len(ends) else ends

    def compact_bytes(self, align: int = COMPACT_ALIGN) -> int:
        """The compact payload's size (its last range's end)."""
        return int(self.placed(align)[-1] + self.lengths[-1]) if len(self.lengths) else 0

    def compact(self, offsets: np.ndarray, lengths: np.ndarray,
                align: int = COMPACT_ALIGN) -> np.ndarray:
        """Where runs at bucket `offsets` (each inside one range) begin in the compact payload
        (`placed`); raises if a run is not needed whole."""
        offsets, lengths = np.asarray(offsets, dtype=_I64), np.asarray(lengths, dtype=_I64)
        at = np.searchsorted(self.starts, offsets, side="right") - 1
        inside = (at >= 0) & (offsets + lengths <= self.starts[at] + self.lengths[at])
        if not inside.all():
            bad = int(np.flatnonzero(~inside)[0])
            raise ValueError(f"bytes {offsets[bad]}..{offsets[bad] + lengths[bad]} are not "
                             f"within one needed range")
        return self.placed(align)[at] + offsets - self.starts[at]


@dataclass(frozen=True)
class Needs:
    """One worker's needs: bucket index -> ranges; a bucket not listed is not needed at all.
    `full=True`: every byte of every bucket (no learned map)."""

    buckets: dict[int, ByteRanges]
    full: bool = False

    def to_json(self) -> str:
        return json.dumps({"full": self.full, "buckets": {str(i): r.encode() for i, r in
                                                          sorted(self.buckets.items())}},
                          separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> Needs:
        raw = json.loads(text)
        return cls({int(i): ByteRanges.decode(g) for i, g in raw["buckets"].items()},
                   bool(raw["full"]))

    @property
    def digest(self) -> str:
        return hashlib.sha256(self.to_json().encode()).hexdigest()

    def nbytes(self) -> int:
        return sum(r.nbytes for r in self.buckets.values())

    def problem(self, bucket_bytes: list[int]) -> str | None:
        """Why these needs cannot be a plan's whose buckets hold `bucket_bytes` bytes (from
        the first tensor on): a bucket it does not have, or bytes past a bucket's end."""
        for index, ranges in sorted(self.buckets.items()):
            if not 0 <= index < len(bucket_bytes):
                return f"bucket {index} is not in the plan ({len(bucket_bytes)} buckets)"
            if len(ranges.starts) and (ranges.starts[0] < 0 or int(
                    ranges.starts[-1] + ranges.lengths[-1]) > bucket_bytes[index]):
                return (f"bucket {index}: bytes {int(ranges.starts[0])}.."
                        f"{int(ranges.starts[-1] + ranges.lengths[-1])} outside its "
                        f"{bucket_bytes[index]} bytes")
        return None


def need_sets(needs: dict[int, Needs]) -> list[tuple[list[int], Needs]]:
    """Ranks grouped by equal needs, in order of their first rank: (ranks, needs)."""
    groups: dict[str, tuple[list[int], Needs]] = {}
    for rank in sorted(needs):
        groups.setdefault(needs[rank].digest, ([], needs[rank]))[0].append(rank)
    return list(groups.values())
