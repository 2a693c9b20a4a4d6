"""What sender and receiver share: the bucket buffers and their views, the frame headers, the
re-plan of need-sets at a refit's start and the compact frames' buffers it calls for, and the
end-of-refit status exchange (`common.transfer.sender` has the protocol)."""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from common.host_memory import host_bytes
from common.packing import BucketLayout
from common.plan import Bucket, RefitPlan, align_up
from common.shard.frames import CompactBuffers
from common.shard.needs import Needs
from common.shard.replan import Route, Sharding
from common.stats import RefitStats
from common.transfer.handshake import exchange_status
from common.transfer.schedule import Schedule
from common.wire import checksum
from common.wire.bucket_header import HEADER_BYTES, STATUS_ABORT, Header
from common.wire.transport import Transport


class Endpoint:
    """Buffers and the end-of-refit status exchange shared by sender and receiver."""

    def __init__(self, group: Transport, plan: RefitPlan) -> None:
        self.group, self.plan = group, plan
        self.num_buffers = plan.config.num_buffers
        self.schedule = Schedule.of(plan, group.supports_subgroups)
        self.checksums = plan.config.checksum and checksum.supported(group.device)
        self.payload_start = align_up(HEADER_BYTES, plan.config.alignment)
        self.pinned = False  # bucket buffers in page-locked host memory (`make_buffers`)
        self.make_buffers()
        self.sharding = Sharding(group, plan, self.schedule)
        self.compact: dict[int, CompactBuffers] = {}  # compact set -> its frame buffers
        self._replans = 0

    def make_buffers(self, pinned: bool = False) -> None:
        """The bucket buffers (`num_slots`, each as large as the largest bucket it holds) and
        each bucket's views of them;
        `pinned`: page-locked host memory (a host group staging onto a GPU: its copies there
        then run asynchronously)."""
        self.pinned, group, schedule = pinned, self.group, self.schedule
        self.slot_of = {b.index: schedule.sender_slot(b) if group.is_trainer
                        else schedule.receiver_slot(b) for b in self.plan.buckets}
        sizes = [0] * self.num_slots
        for b in self.plan.buckets:
            if not b.oversize and self.carries(b):
                sizes[self.slot_of[b.index]] = max(sizes[self.slot_of[b.index]], b.nbytes)
        self.buffers = [host_bytes(self.payload_start + size, group.device, pinned)
                        for size in sizes]
        self.headers = [torch.empty(HEADER_BYTES, dtype=torch.uint8, device=group.device)
                        for _ in sizes]  # a direct bucket's, by slot
        # Each bucket always lands in the same buffer: its views are made once, here (a view
        # costs microseconds of host time, several per bucket per refit otherwise).
        self._frames = {b.index: self.buffers[self.slot_of[b.index]][
            : self.payload_start + b.nbytes] for b in self.plan.buckets}
        self._payloads = {i: v[self.payload_start :] for i, v in self._frames.items()}
        self.layouts = {
            b.index: BucketLayout(self.bucket_buffer(b)[self.payload_start :],
                                  self.plan.bucket_specs(b), b.offsets)
            for b in self.plan.buckets if not b.oversize and self.carries(b)
        }

    @property
    def num_slots(self) -> int:
        """Buffers of each kind this rank keeps: a trainer `num_buffers`, a receiver
        `Schedule.receive_slots`."""
        return self.num_buffers if self.group.is_trainer else self.schedule.receive_slots

    def carries(self, bucket: Bucket) -> bool:
        """Whether this rank's buffers ever hold `bucket` (with concurrent sources a trainer
        holds only the buckets it sources)."""
        return (not self.group.is_trainer or not self.schedule.concurrent
                or bucket.source_rank == self.group.rank)

    def agree_on_needs(self, needs: Needs | None, what: str) -> None:
        """The refit's first exchange (`Sharding.agree`); after a re-plan, the compact sets'
        frame buffers this rank takes part in."""
        self.sharding.agree(needs, what)
        if self.sharding.replans == self._replans:
            return
        self._replans, self.compact, shard = self.sharding.replans, {}, self.sharding.shard
        for index in self.sharding.set_indices() if shard is not None else ():
            if not shard.sets[index].full:
                self.compact[index] = CompactBuffers(self.group.device, self.payload_start,
                                                     shard.frame_bytes(index), self.num_slots,
                                                     self.pinned)

    def header(self, bucket: Bucket, version: int, error: BaseException | None,
               route: Route) -> Header:
        frame = dict(need_set=route.set_index, kind=route.kind,
                     payload_bytes=route.payload_bytes(bucket))
        if error is None:
            return Header(bucket.index, len(self.plan.buckets), version, self.plan.digest,
                          checksummed=self.checksums, **frame)
        return Header(bucket.index, len(self.plan.buckets), version, self.plan.digest,
                      STATUS_ABORT, f"{type(error).__name__}: {error}", **frame)

    def frame(self, bucket: Bucket, route: Route, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A packed frame's [header | payload] buffer and its payload (a compact frame's in
        its set's buffers, a whole bucket's in the bucket buffers)."""
        if route.gather is None:
            return self.bucket_buffer(bucket), self.payload(bucket)
        buffers = self.compact[route.set_index]
        return buffers.frame(slot, route.gather), buffers.payload(slot, route.gather)

    def direct_target(self, bucket: Bucket) -> torch.Tensor:
        """Where a direct bucket's bytes land: the payload region of its buffer, or a fresh
        tensor when it is larger than a buffer (oversize)."""
        if bucket.oversize:
            return host_bytes(bucket.nbytes, self.group.device, self.pinned)
        return self.payload(bucket)

    def bucket_buffer(self, bucket: Bucket) -> torch.Tensor:
        """A bucket's [header | payload] view of its buffer."""
        return self._frames[bucket.index]

    def payload(self, bucket: Bucket) -> torch.Tensor:
        """A packed bucket's bytes in its buffer (after the header)."""
        return self._payloads[bucket.index]

    def wait_all(self, works: Sequence[tuple[object, str]], stats: RefitStats) -> None:
        t0 = time.perf_counter()
        for work, what in works:
            self.group.wait(work, what)
        stats.wait_s += time.perf_counter() - t0

    def finish(self, stats: RefitStats, error: BaseException | None, t0: float) -> RefitStats:
        """Exchange every rank's status; raise on every rank if any rank failed."""
        return exchange_status(self.group, stats, error, t0)
