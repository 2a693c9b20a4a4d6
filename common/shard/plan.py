"""Who receives which bytes of each bucket: need-sets and their compact frames.

Workers that reported equal needs (`common.shard.needs`) form a need-set; workers without a learned
map form the full set. Each bucket goes to each need-set as one frame over the set's subgroup
(every trainer + the set's workers): the full set gets today's whole bucket, a compact set
only the ranges it reads, back to back (`ByteRanges.placed`). A `Gather` says where each
compact byte comes from in the bucket's tensors, split at tensor boundaries, so the sender
copies from its tensors straight into the frame (or, without their addresses, from its packed
bucket). A bucket a set reads nothing of sends it no frame. Plain numpy; both sides import it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from common.plan import Bucket, RefitPlan
from common.shard.needs import ByteRanges, Needs, need_sets

_I64 = np.int64
FULL, COMPACT = 0, 1  # frame kinds, in the bucket header


@dataclass(frozen=True)
class Gather:
    """A compact frame's payload, as pieces: tensor position in the bucket, byte offset in
    that tensor, offset in the payload, length."""

    pos: np.ndarray
    off: np.ndarray
    dst: np.ndarray
    n: np.ndarray
    nbytes: int

    @classmethod
    def of(cls, bucket: Bucket, sizes: list[int], ranges: ByteRanges) -> Gather:
        """The pieces of `ranges` (offsets from the bucket's first tensor) of a bucket whose
        tensors hold `sizes` bytes each; bytes between tensors (alignment) are not copied."""
        t_start = np.asarray(bucket.offsets, dtype=_I64)
        t_end = t_start + np.asarray(sizes, dtype=_I64)
        s, e = ranges.starts, ranges.starts + ranges.lengths
        first = np.searchsorted(t_end, s, side="right")
        last = np.searchsorted(t_start, e, side="left") - 1
        count = np.maximum(last - first + 1, 0)
        which = np.repeat(np.arange(len(s)), count)
        pos = np.repeat(first, count) + np.arange(int(count.sum()), dtype=_I64) - np.repeat(
            np.cumsum(count) - count, count)
        lo = np.maximum(s[which], t_start[pos])
        hi = np.minimum(e[which], t_end[pos])
        keep = hi > lo
        pos, lo, hi, which = pos[keep], lo[keep], hi[keep], which[keep]
        dst = ranges.placed()[which] + lo - s[which]
        return cls(pos, lo - t_start[pos], dst, hi - lo, ranges.compact_bytes())


    def take(self, bucket: Bucket, whole: Any) -> Any:
        """This compact frame's payload made from the whole bucket's payload bytes `whole`
        (a uint8 tensor; the bytes between pieces are zeros)."""
        n = self.n
        starts = np.cumsum(n) - n
        within = np.arange(int(n.sum()), dtype=_I64) - np.repeat(starts, n)
        src = np.repeat(np.asarray(bucket.offsets, dtype=_I64)[self.pos] + self.off, n) + within
        dst = np.repeat(self.dst, n) + within
        out = whole.new_zeros(self.nbytes)
        out[dst] = whole[src]
        return out


@dataclass(frozen=True)
class NeedSet:
    """Workers (refit ranks) with equal needs; `needs.full`: they take whole buckets."""

    index: int
    ranks: tuple[int, ...]
    needs: Needs

    @property
    def full(self) -> bool:
        return self.needs.full


class ShardPlan:
    """The need-sets of one re-plan and each compact set's frames (bucket index -> Gather)."""

    def __init__(self, plan: RefitPlan, needs: dict[int, Needs]) -> None:
        """`needs`: every receiver's; each must have passed `Needs.problem` for `plan`."""
        self.sets = [NeedSet(i, tuple(ranks), n) for i, (ranks, n) in
                     enumerate(need_sets(needs))]
        self.frames: dict[int, dict[int, Gather]] = {}
        for s in self.sets:
            if not s.full:
                self.frames[s.index] = {
                    index: Gather.of(plan.buckets[index],
                                     [spec.nbytes for spec in plan.bucket_specs(
                                         plan.buckets[index])], ranges)
                    for index, ranges in sorted(s.needs.buckets.items())}
        self._set_of = {r: s for s in self.sets for r in s.ranks}

    def set_of(self, rank: int) -> NeedSet:
        return self._set_of[rank]

    def frame_bytes(self, set_index: int) -> int:
        """The largest compact payload of a set (its buffers' size)."""
        return max((g.nbytes for g in self.frames[set_index].values()), default=0)

    def describe(self) -> str:
        parts = []
        for s in self.sets:
            what = "full buckets" if s.full else f"{s.needs.nbytes() / 1e6:.1f} MB"
            parts.append(f"set {s.index} ranks {list(s.ranks)}: {what}")
        return "; ".join(parts)

