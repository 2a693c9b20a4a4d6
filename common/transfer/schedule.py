"""The transfer schedule: each frame's stream and buffer slot, and the one order of issue.

Made once per plan, from the plan alone, identically on every rank. With concurrent sources
(`RefitConfig.concurrent_sources`, a plan with two or more source ranks) each source rank's
buckets form that source's own stream, sent over communicators that hold only the source and
the workers that receive the frame (`common.shard.replan` builds them); no trainer takes part in
a frame another trainer sources, so the sources gather, pack and send at the same time, each
through its own `num_buffers` rotating buffers. A receiver keeps `receive_slots` buffers
(`num_buffers` per stream, at most `RefitConfig.receive_buffers`: a worker's memory stays
bounded however many sources there are), posts its receives in plan order up to that many
frames ahead, from any streams, and applies a frame as soon as it has arrived, whichever stream
it came from (`common.transfer.streams`).

Order rule: every rank issues everything it waits on in plan order. A source gathers (its
weight source's collectives over the training group, which every trainer runs in plan order)
and sends its buckets in plan order, waiting before bucket k only for its own frame k - N; a
worker posts its receives in plan order, each once every frame before it is posted and its
slot's previous frame (earlier in plan order) has been applied. So every wait is for an
operation at an earlier plan position or for the peers of the same one, and by induction along
plan order every operation is issued by all its peers: nothing can hang, however the streams'
speeds differ and whatever training-group collectives the sources share. No two ranks issue two
common operations in opposite orders (NCCL: operations on communicators that share a GPU can
deadlock otherwise); the tests check this on every rank's record of issue. For the streams to
run at once the plan takes its sources in turn (`RefitPlan.build` interleaves its buckets by
bytes when concurrent sources are on: `common.plan.interleave`); in a plan that lists one
source's buckets after another's, the later source runs at most `num_buffers` frames ahead.
"""

from __future__ import annotations

from dataclasses import dataclass

from common.plan import Bucket, RefitPlan


def imbalance(loads: list[int] | dict[int, int]) -> float:
    """The busiest one's load over the mean (1.0: balanced; 1.0 with nothing to balance)."""
    values = list(loads.values()) if isinstance(loads, dict) else list(loads)
    total = sum(values)
    return max(values) * len(values) / total if total else 1.0


@dataclass(frozen=True)
class Schedule:
    """The streams of one plan; `concurrent` False: one stream, as without concurrent sources
    (every bucket's slot its index modulo `num_buffers`)."""

    concurrent: bool
    num_buffers: int
    receive_buffers: int  # `RefitConfig.receive_buffers`
    sources: tuple[int, ...]  # source ranks, one stream each
    position: tuple[int, ...]  # bucket index -> its place in its stream
    source_bytes: dict[int, int]  # source rank -> payload bytes it sends per refit

    @classmethod
    def of(cls, plan: RefitPlan, subgroups: bool = True) -> Schedule:
        """`subgroups`: whether the transport can build stream communicators (else one
        ordered stream, whatever the config says)."""
        sources = tuple(sorted({b.source_rank for b in plan.buckets}))
        concurrent = plan.config.concurrent_sources and subgroups and len(sources) >= 2
        position, loads = [], dict.fromkeys(sources, 0)
        counts = dict.fromkeys(sources, 0)
        for bucket in plan.buckets:
            position.append(counts[bucket.source_rank])
            counts[bucket.source_rank] += 1
            loads[bucket.source_rank] += bucket.nbytes
        return cls(concurrent, plan.config.num_buffers, plan.config.receive_buffers, sources,
                   tuple(position), loads)

    @property
    def num_streams(self) -> int:
        return len(self.sources) if self.concurrent else 1

    def sender_slot(self, bucket: Bucket) -> int:
        """The slot of the source's own buffers this bucket is packed and sent from."""
        if not self.concurrent:
            return bucket.index % self.num_buffers
        return self.position[bucket.index] % self.num_buffers

    @property
    def receive_slots(self) -> int:
        """A receiver's buffers of each kind: `num_buffers` per stream, at most
        `RefitConfig.receive_buffers` (never fewer than `num_buffers`)."""
        if not self.concurrent:
            return self.num_buffers
        return max(self.num_buffers, min(self.receive_buffers,
                                         self.num_buffers * len(self.sources)))

    def receiver_slot(self, bucket: Bucket) -> int:
        """The receive buffer a whole bucket lands in (the k-th frame of a receiver that takes
        every bucket: slot k modulo `receive_slots`)."""
        return bucket.index % self.receive_slots

    def source_imbalance(self) -> float:
        """The busiest source's bytes over the mean source's."""
        return imbalance(self.source_bytes)
