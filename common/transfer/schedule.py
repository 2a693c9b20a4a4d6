"""The transfer schedule: each frame's stream, its buffer slot, and the one order of issue.

Made once per plan, from the plan alone, identically on every rank. With concurrent sources
(`RefitConfig.concurrent_sources`, a plan with two or more source ranks) each source rank's
buckets form that source's own stream, sent over communicators that hold only the source and
the workers that receive the frame (`common.shard.replan` builds them); no trainer takes part in
a frame another trainer sources, so the sources gather, pack and send at the same time, each
through its own `num_buffers` rotating buffers. A receiver keeps `num_buffers` buffers per
stream, posts its receives up to that many frames ahead in each stream and applies a frame as
soon as it has arrived, whichever stream it came from.

Order rule (NCCL: operations on communicators that share a GPU can deadlock unless every rank
issues them in one order). Every rank issues the collectives it takes part in as a subsequence
of `Schedule.order`: a source its own stream, which is that order restricted to it; a worker
posts its receives in that order (only the applying follows arrival). Two stream
communicators share either their source (whose frames all lie in its stream, in order) or
workers (which post in `order`), so no two ranks issue any two operations in opposite orders.
Every frame is posted once all frames before it in `order` are posted and its slot's previous
frame has been applied: by induction along `order`, every posted frame's peers post it too.
`order` merges the streams by bytes (a frame's place: the bytes its stream sends before it), so
streams of equal speed keep every worker's receives spread over all sources.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

from common.plan import Bucket, RefitPlan


def imbalance(loads: list[int] | dict[int, int]) -> float:
    """The busiest one's load over the mean (1.0: balanced; 1.0 with nothing to balance)."""
    values = list(loads.values()) if isinstance(loads, dict) else list(loads)
    total = sum(values)
    return max(values) * len(values) / total if total else 1.0


@dataclass(frozen=True)
class Schedule:
    """The streams of one plan; `concurrent` False: one ordered stream, plan order, as without
    concurrent sources (every bucket's slot its index modulo `num_buffers`)."""

    concurrent: bool
    num_buffers: int
    sources: tuple[int, ...]  # source ranks, in stream order
    stream: tuple[int, ...]  # bucket index -> its stream (index into `sources`)
    position: tuple[int, ...]  # bucket index -> its place in its stream
    order: tuple[int, ...]  # bucket indices in the order every rank issues them
    source_bytes: dict[int, int]  # source rank -> payload bytes it sends per refit

    @classmethod
    def of(cls, plan: RefitPlan, subgroups: bool = True) -> Schedule:
        """`subgroups`: whether the transport can build stream communicators (else one
        ordered stream, whatever the config says)."""
        sources = tuple(sorted({b.source_rank for b in plan.buckets}))
        concurrent = plan.config.concurrent_sources and subgroups and len(sources) >= 2
        stream_of = {rank: i for i, rank in enumerate(sources)}
        counts = [0] * len(sources)
        stream, position, loads = [], [], dict.fromkeys(sources, 0)
        for bucket in plan.buckets:
            i = stream_of[bucket.source_rank]
            stream.append(i)
            position.append(counts[i])
            counts[i] += 1
            loads[bucket.source_rank] += bucket.nbytes
        order = _merge_by_bytes(plan.buckets, stream) if concurrent else \
            tuple(range(len(plan.buckets)))
        return cls(concurrent, plan.config.num_buffers, sources, tuple(stream),
                   tuple(position), order, loads)

    @property
    def num_streams(self) -> int:
        return len(self.sources) if self.concurrent else 1

    def sender_slot(self, bucket: Bucket) -> int:
        """The slot of the source's own buffers this bucket is packed and sent from."""
        if not self.concurrent:
            return bucket.index % self.num_buffers
        return self.position[bucket.index] % self.num_buffers

    def receiver_slot(self, bucket: Bucket) -> int:
        """The slot of a receiver's buffers (`num_buffers` per stream) a whole bucket lands in."""
        if not self.concurrent:
            return bucket.index % self.num_buffers
        return self.stream[bucket.index] * self.num_buffers + \
            self.position[bucket.index] % self.num_buffers

    def stream_slots(self, stream: int) -> range:
        """A receiver's slots of `stream`."""
        n = self.num_buffers
        return range(stream * n, stream * n + n) if self.concurrent else range(n)

    def source_imbalance(self) -> float:
        """The busiest source's bytes over the mean source's."""
        return imbalance(self.source_bytes)


def _merge_by_bytes(buckets: tuple[Bucket, ...], stream: list[int]) -> tuple[int, ...]:
    """Bucket indices with every stream in its own order, the streams merged by the bytes
    each sends before the bucket (ties: the lower stream first)."""
    heads: dict[int, list[Bucket]] = {}
    for bucket in buckets:
        heads.setdefault(stream[bucket.index], []).append(bucket)
    heap = [(0, s, 0) for s in heads]
    heapq.heapify(heap)
    order = []
    while heap:
        sent, s, k = heapq.heappop(heap)
        bucket = heads[s][k]
        order.append(bucket.index)
        if k + 1 < len(heads[s]):
            heapq.heappush(heap, (sent + bucket.nbytes, s, k + 1))
    return tuple(order)
