"""Coalescing, multi-buffered broadcaster: one collective per bucket, N buffers in rotation.

Protocol (identical collective sequence on every rank, whatever fails, so nothing can hang):
  setup:   rank 0 broadcasts the plan; every rank checks it against its own (digest) and all
           ranks learn of any mismatch through one all-gather.
  refit:   per bucket one broadcast of [header | payload] from the bucket's source rank (a
           direct bucket, one large tensor: a header broadcast, then its bytes straight from the
           tensor into the receive buffer, or into a tensor of its own when oversize);
           then one all-gather of every rank's status, so every rank learns whether the refit
           landed everywhere. With shard-to-shard (`common.shard.replan`) the refit starts with an
           all-gather of needs digests (and a re-plan when they changed), and each bucket goes
           as one frame per need-set over the set's subgroup: whole to the full set, only the
           set's bytes to a compact set (`common.shard.frames`).
The sender gathers bucket k+1 before waiting for its buffer and packs it while bucket k is on
the wire (gloo works on its own thread; NCCL kernels run on the process group's stream while the
pack runs on the compute stream). A buffer is reused only after the host has waited for its
previous collective (with the timeout), so packing never overwrites bytes in flight and every
wait can time out; a frame sent by graph replay (pack, header and broadcast on the compute
stream) comes before anything the stream does next, so its buffer is reused without the host
waiting, and the replays are waited for (with the timeout) after the last bucket. On an error
the sender keeps draining the weight source (its gathers stay in step on all training ranks)
and sends ABORT headers instead of payloads; receivers stop loading at the first ABORT.
"""

from __future__ import annotations

import logging
import struct
import time
from collections.abc import Iterator

import numpy as np
import torch

from common.delta.frames import ShadowSender
from common.errors import (
    RefitCommError,
    RefitError,
    TensorMismatchError,
)
from common.gc_pause import gc_paused
from common.kernels import native
from common.packing import byte_view
from common.plan import Bucket, RefitPlan
from common.shard.replan import Route
from common.source import WeightSource
from common.stats import RefitStats
from common.timer_slack import fine_timer_slack
from common.transfer.bucket_check import BucketChecker
from common.transfer.endpoint import Endpoint
from common.transfer.graph_frames import GraphFrames, ReplayWork
from common.transfer.handshake import agree_on_plan
from common.transfer.receiver import RefitReceiver
from common.transfer.schedule import imbalance
from common.wire import checksum
from common.wire.bucket_header import (
    HEADER_BYTES,
    STATUS_NONFINITE,
    STATUS_OFFSET,
    VERSION_SLICE,
)
from common.wire.transport import Transport

log = logging.getLogger(__name__)
__all__ = ["RefitReceiver", "RefitSender", "RefitStats"]  # the receiver lives in its own file


class RefitSender(Endpoint):
    """Runs on every training rank; the plan's source ranks send, the others take part."""

    def __init__(self, group: Transport, plan: RefitPlan) -> None:
        super().__init__(group, plan)
        self.checker = BucketChecker(plan, group.rank, group.device, group.label)
        self.shadows = ShadowSender(self) if plan.config.delta else None
        self._headers: tuple | None = None  # `header_table`'s
        self._checks: list = []  # a refit's (bucket, check) per frame its source filled
        self.closed = False  # `close` released its graphs
        self.graphs = (GraphFrames(group, self.checksums, per_run=self.num_buffers + 1)
                       if plan.config.graph_send and group.captures_broadcasts else None)
        for bucket in plan.buckets:  # the first refit then runs at the speed of the others
            if bucket.source_rank == group.rank and not bucket.direct:
                self.layouts[bucket.index].warm()

    @classmethod
    def setup(cls, group: Transport, plan: RefitPlan) -> RefitSender:
        if not group.is_trainer:
            raise ValueError(f"{group.label} is not a training rank; use RefitReceiver")
        native.load()  # a first build (~25 s) happens here, before the group waits on us
        return cls(group, agree_on_plan(group, plan))

    def close(self) -> None:
        """Release the CUDA graphs this sender captured (its frames', its pack kernels') now,
        not at a later garbage collection: call it when the sender is replaced (a new plan,
        a new group). A refit after it raises. With `graph_send`, frame graphs captured after
        others were destroyed launch more slowly on the device (docs/architecture.md)."""
        if self.graphs is not None:
            self.graphs.release()
        for layout in self.layouts.values():
            layout.release()
        self.graphs, self.closed = None, True

    def keep_shadows_of(self, old: RefitSender | None) -> None:
        """Carry the shadows of `old` (this trainer's sender in a group that failed, same
        plan) over: the next refit can still be a delta."""
        if old is not None and old.shadows and self.shadows and \
                old.plan.digest == self.plan.digest:
            self.shadows.stores = old.shadows.stores

    def header_table(self, version: int,
                     routes: list[list[Route]]) -> tuple[torch.Tensor, dict[tuple, int]]:
        """Every frame's OK header for this refit, moved to the device in one copy (a copy per
        frame costs a synchronous host-to-device transfer each on CUDA), and each frame's row
        by (bucket, need-set). The headers are encoded once per re-plan, into a device table
        that stays put (graph replays stage its rows' addresses once); a refit only writes its
        version into them (the copy follows the last refit's reads on the stream)."""
        if self._headers is None or self._headers[0] != self.sharding.replans:
            rows, raw = {}, []
            for bucket, frames in zip(self.plan.buckets, routes, strict=True):
                for route in frames:
                    rows[bucket.index, route.set_index] = len(raw)
                    raw.append(self.header(bucket, 0, None, route).encode_bytes())
            table = np.frombuffer(b"".join(raw), dtype=np.uint8).reshape(-1, HEADER_BYTES)
            on_device = torch.empty(table.shape, dtype=torch.uint8, device=self.group.device)
            self._headers = (self.sharding.replans, table, rows, on_device)
        _, table, rows, on_device = self._headers
        table = table.copy()
        table[:, VERSION_SLICE] = np.frombuffer(struct.pack("<q", version), dtype=np.uint8)
        return on_device.copy_(torch.from_numpy(table)), rows

    def refit(self, source: WeightSource, version: int) -> RefitStats:
        """Send one complete set of weights, tagged `version`; returns this rank's stats.
        With deltas on, the shadows take this version only if it landed on every rank.
        Python's garbage collector is paused meanwhile (`common.gc_pause`), and on CUDA the
        thread's timer slack cut so that the waits' sleeps end on time (`common.timer_slack`)."""
        if self.closed:
            raise RefitError(f"{self.group.label}: refit v{version} on a closed sender (set "
                             "up a new one with RefitSender.setup)")
        try:
            with gc_paused(), fine_timer_slack(self.group.device.type == "cuda"):
                stats = self._refit(source, version)
        except BaseException:
            if self.shadows is not None:
                self.shadows.abort()  # the engines hold (or rolled back to) the last version
            raise
        if self.shadows is not None:
            t0 = time.perf_counter()
            self.shadows.commit(version)
            stats.delta_s += time.perf_counter() - t0
            stats.seconds += time.perf_counter() - t0
        return stats

    def _refit(self, source: WeightSource, version: int) -> RefitStats:
        plan, group = self.plan, self.group
        stats = RefitStats(version, len(plan.buckets), plan.total_bytes)
        t0 = time.perf_counter()
        self.agree_on_needs(None, f"refit v{version}")
        modes = self.shadows.modes(f"refit v{version}") if self.shadows else {}
        stats.replan_s = time.perf_counter() - t0
        self._stream_stats(stats)
        if self.graphs is not None:  # subgroups made by a re-plan: capture their broadcasts
            self.graphs.start_refit(self.sharding.replans)
        routes = [self.sharding.routes(b) for b in plan.buckets]
        it: Iterator | None = iter(source.iter_tensors(plan))
        self._checks = []
        error: BaseException | None = None
        pending: dict[tuple[int, int], list] = {}  # (need-set, slot) -> works in flight
        replayed: list = []  # frames sent by graph replay whose slots were reused since
        held: dict[tuple[int, int], torch.Tensor | None] = {}
        table = self.header_table(version, routes)
        # A failed collective kills the refit group; this rank then stops using it but still
        # drains the weight source, so its gathers on the training groups stay in step with
        # the other training ranks (they reach the same state at their own next wait).
        dead: RefitCommError | None = None
        for bucket in plan.buckets:
            # The bucket is taken (gathered, checked) before its buffer is waited for: that
            # host work overlaps the collectives in flight, with 2 buffers as with 3.
            tensors: list = []
            ptrs = None
            if it is not None:
                t1 = time.perf_counter()
                try:
                    tensors, ptrs = self.checker.take(it, bucket, version)
                except TensorMismatchError as e:
                    error = error or e
                except Exception as e:  # noqa: BLE001 - the source is broken: stop iterating
                    error, it = error or e, None
                stats.produce_s += time.perf_counter() - t1
            for key in self._slots(bucket, routes[bucket.index]):
                works = pending.pop(key, [])
                if works and all(isinstance(work, ReplayWork) for work, _ in works):
                    replayed += works  # ordered before the slot's next use: waited at the end
                else:
                    dead = dead or self._settle(works, stats)
                held.pop(key, None)
            if dead is None:
                error, dead = self._send_frames((bucket, version, tensors, ptrs),
                                                routes[bucket.index], modes, table,
                                                pending, held, error, stats)
            del tensors, ptrs  # the source's copies go before the next bucket is gathered
        if self.graphs is not None and dead is None:
            self.graphs.flush()  # the frames still in a pending run
        for works in [replayed, *pending.values()]:
            dead = dead or self._settle(works, stats)
        stats.send_s = time.perf_counter() - t0
        if dead is not None:
            raise dead  # no status exchange over a dead group
        error = error or self._filled_error(version)
        if it is not None and error is None and next(it, None) is not None:
            error = RefitError(f"{group.label}: weight source yields more tensors than the plan's "
                               f"{len(plan.specs)}")
        return self.finish(stats, error, t0)

    def _stream_stats(self, stats: RefitStats) -> None:
        """How many source streams run and how evenly bytes spread over sources and workers."""
        stats.sources = self.schedule.num_streams
        stats.source_imbalance = self.schedule.source_imbalance()
        stats.worker_imbalance = imbalance(self.sharding.worker_bytes())

    def _send_frames(self, frame: tuple, routes: list[Route], modes: dict[int, int], table,
                     pending: dict, held: dict, error, stats: RefitStats,
                     ) -> tuple[BaseException | None, RefitCommError | None]:
        """Start one bucket's frames (`frame`: bucket, version, tensors, pointers), one per
        route; a delta-mode frame's time goes to `delta_s`, a whole frame's to `pack_s`.
        Returns the refit's error and, if the group died, its error."""
        bucket, version, tensors, ptrs = frame
        for route in routes:
            key, t1 = (route.set_index, self.slot_of[bucket.index]), time.perf_counter()
            if route.set_index not in modes:
                pending[key], held[key], error = self._send(bucket, version, tensors, ptrs,
                                                            error, table, route)
                stats.pack_s += time.perf_counter() - t1
                continue
            try:  # a frame another trainer sources waits for its header here
                pending[key], held[key], error = self._send_delta(
                    bucket, version, tensors, ptrs, error, route, modes[route.set_index])
            except RefitCommError as e:
                return error, e
            stats.delta_s += time.perf_counter() - t1
        return error, None

    def _slots(self, bucket: Bucket, routes: list[Route]) -> list[tuple[int, int]]:
        """The (need-set, slot) buffers whose collectives must end before `bucket` is packed:
        its own slot per frame; for an oversize whole bucket every slot of its set (at most
        one oversize tensor is alive beyond the N buffers)."""
        slot = self.slot_of[bucket.index]
        slots = range(self.num_buffers) if bucket.oversize else [slot]
        return [(r.set_index, s) for r in routes for s in (slots if r.gather is None else [slot])]

    def _send(self, bucket: Bucket, version: int, tensors: list, ptrs, error,
              table: tuple[torch.Tensor, dict], route: Route,
              ) -> tuple[list, torch.Tensor | None, BaseException | None]:
        """Pack (on its source) and start one frame's broadcasts; returns the works, the
        tensor they hold (alive until waited) and the refit's error so far."""
        group, slot = self.group, self.slot_of[bucket.index]
        is_src, src, sub = group.rank == bucket.source_rank, bucket.source_rank, route.sub
        what = f"refit v{version} bucket {bucket.index}/{len(self.plan.buckets)}"
        if route.set_index >= 0:
            what += f" to need-set {route.set_index}"
        direct = bucket.direct and route.gather is None
        # The header leads the frame's own buffer, or has a buffer of its own (direct).
        wire, payload = (self.headers[slot], None) if direct else self.frame(bucket, route, slot)
        row = table[1][bucket.index, route.set_index]
        # the frame's header row, whose status word a fill marks NONFINITE
        header_at = table[0].data_ptr() + row * HEADER_BYTES
        mark = (header_at + STATUS_OFFSET, STATUS_NONFINITE)
        if (is_src and error is None and not direct and route.gather is None
                and self.graphs is not None and self.shadows is None):
            work, error = self._replay(bucket, route, (wire, payload, route.sub), tensors, ptrs,
                                       (header_at, mark), what)
            if work is not None:
                return [(work, what)], None, error
        if self.graphs is not None:  # frames of a pending run go first (stream, group)
            self.graphs.flush()
        if is_src and error is None:
            try:  # a failing pack (device, memory) becomes an ABORT like any other error
                payload = self._pack(bucket, route, tensors, ptrs, mark)
                if self.shadows is not None:  # a whole frame in a refit with deltas on
                    self.shadows.keep(bucket, route, payload)
            except Exception as e:  # noqa: BLE001 - reported to every rank
                error = RefitError(f"{group.label}: packing {what} failed: {e}")
        row = table[0][row]  # after the pack: a fill may have marked its status
        if is_src and error is not None:
            wire[:HEADER_BYTES].copy_(self.header(bucket, version, error, route).encode())
        elif is_src and direct:
            wire = row
        elif is_src:
            wire[:HEADER_BYTES].copy_(row, non_blocking=True)
        if is_src and error is None and self.checksums:
            checksum.stamp(wire, payload)
        if not direct:
            return [(group.broadcast(wire, src, sub), what)], None, error
        if payload is None:  # not the source, or aborting: bytes to receive / discard
            payload = self.direct_target(bucket)
        return [(group.broadcast(wire, src, sub), what + " header"),
                (group.broadcast(payload, src, sub), what)], payload, error

    def _replay(self, bucket: Bucket, route: Route, frame: tuple, tensors, ptrs,
                header: tuple[int, tuple[int, int]],
                what: str) -> tuple[object | None, BaseException | None]:
        """The frame as a graph replay (`GraphFrames`): from the sources' addresses, or filled
        by its source (`PreparedBucket.stage_fill`, its check kept for `_filled_error`).
        Returns what to wait for (None: send it eagerly) and the refit's error (a failure
        before the replay: an ABORT like a failing pack). `header`: the frame's header row
        address and the fill's mark."""
        key, layout = (bucket.index, route.set_index), self.layouts[bucket.index]
        header_at, mark = header
        try:
            if ptrs is not None:
                return self.graphs.send(key, layout, frame, ptrs, header_at,
                                        self.checker.held), None
            prepared = getattr(tensors, "prepared", None)
            if (prepared is None or prepared.stage_fill is None
                    or prepared.device != self.group.device):
                return None, None
            work, check = self.graphs.send_filled(key, layout, frame, prepared, header_at,
                                                  mark)
            if work is not None:
                self._checks.append((bucket, check))
            return work, None
        except Exception as e:  # noqa: BLE001 - reported to every rank
            return None, RefitError(f"{self.group.label}: replaying {what} failed: {e}")

    def _pack(self, bucket: Bucket, route: Route, tensors: list, ptrs,
              mark: tuple[int, int] | None = None) -> torch.Tensor:
        """The frame's payload, from the bucket's tensors (a direct bucket: its tensor's own
        bytes; else packed or gathered into its buffer). `mark`: the frame's header status
        word on the device and NONFINITE, when the source may fill the frame itself and mark
        it (`PreparedBucket.fill`; its check runs after the last frame, `_filled_error`)."""
        slot = self.slot_of[bucket.index]
        if bucket.direct and route.gather is None:
            return byte_view(tensors[0].contiguous())
        prepared = getattr(tensors, "prepared", None)
        if route.gather is not None:
            self.compact[route.set_index].fill(slot, bucket.index, route.gather, tensors, ptrs)
        elif (mark and prepared is not None and prepared.fill is not None
              and prepared.device == self.group.device
              and (check := self.layouts[bucket.index].fill(prepared, mark)) is not None):
            self._checks.append((bucket, check))
        else:
            self.layouts[bucket.index].pack(tensors, ptrs)
        return self.frame(bucket, route, slot)[1]

    def _filled_error(self, version: int) -> RefitError | None:
        """Why a frame the source filled must not count (checked once the stream's work is
        done: the first check waits for it), or None."""
        for bucket, check in self._checks:
            if why := check():
                return RefitError(f"{self.group.label}: refit v{version} bucket "
                                  f"{bucket.index}/{len(self.plan.buckets)}: {why}")
        return None

    def _send_delta(self, bucket: Bucket, version: int, tensors: list, ptrs, error,
                    route: Route, base: int) -> tuple[list, object, BaseException | None]:
        """One frame of a need-set in delta mode (`common.delta.frames`): its source packs,
        encodes and sends it; the other trainers take part."""
        what = (f"refit v{version} bucket {bucket.index}/{len(self.plan.buckets)} to need-set "
                f"{route.set_index}")
        if self.group.rank != bucket.source_rank:
            works, held = self.shadows.pass_on(bucket, route, what)
            return works, held, error
        if error is None:
            try:
                payload = self._pack(bucket, route, tensors, ptrs)
                works, held = self.shadows.send(bucket, route,
                                                self.header(bucket, version, None, route),
                                                payload, base)
                return works, held, error
            except Exception as e:  # noqa: BLE001 - reported to every rank
                error = RefitError(f"{self.group.label}: packing or encoding {what} failed: "
                                   f"{type(e).__name__}: {e}")
        works, held = self.shadows.send(bucket, route, self.header(bucket, version, error, route),
                                        None, base)
        return works, held, error

    def _settle(self, works: list, stats: RefitStats) -> RefitCommError | None:
        """Wait for `works`; a failure is returned (the group is dead), not raised."""
        try:
            self.wait_all(works, stats)
        except RefitCommError as e:
            return e
        return None
