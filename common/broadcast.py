"""Coalescing, multi-buffered broadcaster: one collective per bucket, N buffers in rotation.

Protocol (identical collective sequence on every rank, whatever fails, so nothing can hang):
  setup:   rank 0 broadcasts the plan; every rank checks it against its own (digest) and all
           ranks learn of any mismatch through one all-gather.
  refit:   per bucket one broadcast of [header | payload] from the bucket's source rank (a
           direct bucket, one large tensor: a header broadcast, then its bytes straight from the
           tensor into the receive buffer, or into a tensor of its own when oversize);
           then one all-gather of every rank's status, so every rank learns whether the refit
           landed everywhere. With shard-to-shard (`common.sharding`) the refit starts with an
           all-gather of needs digests (and a re-plan when they changed), and each bucket goes
           as one frame per need-set over the set's subgroup: whole to the full set, only the
           set's bytes to a compact set (`common.shard_frames`).
The sender packs bucket k+1 while bucket k is on the wire (gloo works on its own thread; NCCL
kernels run on the process group's stream while the pack runs on the compute stream). A buffer
is reused only after the host has waited for its previous collective (with the timeout), so
packing never overwrites bytes in flight and every wait can time out. On an error the sender
keeps draining the weight source (its gathers stay in step on all training ranks) and sends
ABORT headers instead of payloads; receivers stop loading at the first ABORT.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator

import torch

from common.bucket_check import BucketChecker
from common.endpoint import Endpoint
from common.errors import (
    RefitAborted,
    RefitCommError,
    RefitError,
    TensorMismatchError,
)
from common.handshake import PlanCheck, agree_on_plan
from common.kernels import native
from common.needs import Needs
from common.packing import byte_view
from common.plan import Bucket, RefitPlan
from common.sharding import Route
from common.source import WeightSource
from common.stats import RefitStats
from common.wire import checksum
from common.wire.bucket_header import HEADER_BYTES, STATUS_OK, Header
from common.wire.transport import Transport

log = logging.getLogger(__name__)
BucketCallback = Callable[[list[tuple[str, torch.Tensor]]], None]
CompactCallback = Callable[[int, torch.Tensor], None]


class RefitSender(Endpoint):
    """Runs on every training rank; the plan's source ranks send, the others take part."""

    def __init__(self, group: Transport, plan: RefitPlan) -> None:
        super().__init__(group, plan)
        self.checker = BucketChecker(plan, group.rank, group.device, group.label)
        for bucket in plan.buckets:  # the first refit then runs at the speed of the others
            if bucket.source_rank == group.rank and not bucket.direct:
                self.layouts[bucket.index].warm()

    @classmethod
    def setup(cls, group: Transport, plan: RefitPlan) -> RefitSender:
        if not group.is_trainer:
            raise ValueError(f"{group.label} is not a training rank; use RefitReceiver")
        native.load()  # a first build (~25 s) happens here, before the group waits on us
        return cls(group, agree_on_plan(group, plan))

    def header_table(self, version: int,
                     routes: list[list[Route]]) -> tuple[torch.Tensor, dict[tuple, int]]:
        """Every frame's OK header for this refit, moved to the device in one copy (a copy per
        frame costs a synchronous host-to-device transfer each on CUDA), and each frame's row
        by (bucket, need-set)."""
        rows, raw = {}, []
        for bucket, frames in zip(self.plan.buckets, routes, strict=True):
            for route in frames:
                rows[bucket.index, route.set_index] = len(raw)
                raw.append(self.header(bucket, version, None, route).encode_bytes())
        table = torch.frombuffer(bytearray(b"".join(raw)), dtype=torch.uint8)
        return table.view(-1, HEADER_BYTES).to(self.group.device), rows

    def refit(self, source: WeightSource, version: int) -> RefitStats:
        """Send one complete set of weights, tagged `version`; returns this rank's stats."""
        plan, group = self.plan, self.group
        stats = RefitStats(version, len(plan.buckets), plan.total_bytes)
        t0 = time.perf_counter()
        self.agree_on_needs(None, f"refit v{version}")
        stats.replan_s = time.perf_counter() - t0
        routes = [self.sharding.routes(b) for b in plan.buckets]
        it: Iterator | None = iter(source.iter_tensors(plan))
        error: BaseException | None = None
        pending: dict[tuple[int, int], list] = {}  # (need-set, slot) -> works in flight
        held: dict[tuple[int, int], torch.Tensor | None] = {}
        table = self.header_table(version, routes)
        # A failed collective kills the refit group; this rank then stops using it but still
        # drains the weight source, so its gathers on the training groups stay in step with
        # the other training ranks (they reach the same state at their own next wait).
        dead: RefitCommError | None = None
        for bucket in plan.buckets:
            slot = bucket.index % self.num_buffers
            for key in self._slots(bucket, routes[bucket.index]):
                dead = dead or self._settle(pending.pop(key, []), stats)
                held.pop(key, None)
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
            if dead is not None:
                continue
            t1 = time.perf_counter()
            for route in routes[bucket.index]:
                key = (route.set_index, slot)
                pending[key], held[key], error = self._send(bucket, version, tensors, ptrs,
                                                            error, table, route)
            stats.pack_s += time.perf_counter() - t1
            del tensors
        for works in pending.values():
            dead = dead or self._settle(works, stats)
        stats.send_s = time.perf_counter() - t0
        if dead is not None:
            raise dead  # no status exchange over a dead group
        if it is not None and error is None and next(it, None) is not None:
            error = RefitError(f"{group.label}: weight source yields more tensors than the plan's "
                               f"{len(plan.specs)}")
        return self.finish(stats, error, t0)

    def _slots(self, bucket: Bucket, routes: list[Route]) -> list[tuple[int, int]]:
        """The (need-set, slot) buffers whose collectives must end before `bucket` is packed:
        its own slot per frame; for an oversize whole bucket every slot of its set (at most
        one oversize tensor is alive beyond the N buffers)."""
        slots = range(self.num_buffers) if bucket.oversize else [bucket.index % self.num_buffers]
        return [(r.set_index, s) for r in routes
                for s in (slots if r.gather is None else [bucket.index % self.num_buffers])]

    def _send(self, bucket: Bucket, version: int, tensors: list, ptrs, error,
              table: tuple[torch.Tensor, dict], route: Route,
              ) -> tuple[list, torch.Tensor | None, BaseException | None]:
        """Pack (on its source) and start one frame's broadcasts; returns the works, the
        tensor they hold (alive until waited) and the refit's error so far."""
        group, slot = self.group, bucket.index % self.num_buffers
        is_src, src, sub = group.rank == bucket.source_rank, bucket.source_rank, route.sub
        what = f"refit v{version} bucket {bucket.index}/{len(self.plan.buckets)}"
        if route.set_index >= 0:
            what += f" to need-set {route.set_index}"
        direct = bucket.direct and route.gather is None
        # The header leads the frame's own buffer, or has a buffer of its own (direct).
        wire, payload = (self.headers[slot], None) if direct else self.frame(bucket, route, slot)
        if is_src and error is None:
            try:  # a failing pack (device, memory) becomes an ABORT like any other error
                if direct:
                    payload = byte_view(tensors[0].contiguous())
                elif route.gather is not None:
                    self.compact[route.set_index].fill(slot, bucket.index, route.gather,
                                                       tensors, ptrs)
                else:
                    self.layouts[bucket.index].pack(tensors, ptrs)
            except Exception as e:  # noqa: BLE001 - reported to every rank
                error = RefitError(f"{group.label}: packing {what} failed: {e}")
        row = table[0][table[1][bucket.index, route.set_index]]
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

    def _settle(self, works: list, stats: RefitStats) -> RefitCommError | None:
        """Wait for `works`; a failure is returned (the group is dead), not raised."""
        try:
            self.wait_all(works, stats)
        except RefitCommError as e:
            return e
        return None


class RefitReceiver(Endpoint):
    """Runs on every inference rank: receives each bucket and hands its tensors to a callback."""

    @classmethod
    def setup(
        cls,
        group: Transport,
        plan: RefitPlan | None = None,
        check: PlanCheck | None = None,
    ) -> RefitReceiver:
        """Join the plan handshake; pass `plan` to insist on it, `check` to vet rank 0's plan
        (a mismatch or a refusal fails the setup on every rank)."""
        if group.is_trainer:
            raise ValueError(f"{group.label} is a training rank; use RefitSender")
        return cls(group, agree_on_plan(group, plan, check))

    def __init__(self, group: Transport, plan: RefitPlan) -> None:
        super().__init__(group, plan)
        # What this worker reads of each bucket (`common.needs`) once it knows (a learned
        # load map); reported at each refit's start. None: every byte.
        self.needs: Needs | None = None

    def owns(self, tensor: torch.Tensor) -> bool:
        """Whether `tensor` is a view into one of this receiver's reusable buffers."""
        ptr = tensor.untyped_storage().data_ptr()
        buffers = [*self.buffers, *(b for c in self.compact.values() for b in c.buffers)]
        return any(ptr == b.untyped_storage().data_ptr() for b in buffers)

    def _post(self, bucket: Bucket, route: Route,
              ordinal: int) -> tuple[list, torch.Tensor | None]:
        what = f"refit bucket {bucket.index}/{len(self.plan.buckets)}"
        src, sub = bucket.source_rank, route.sub
        if route.gather is not None:
            frame = self.frame(bucket, route, ordinal)[0]
            return [(self.group.broadcast(frame, src, sub), what)], None
        if bucket.direct:
            hbuf = self.headers[bucket.index % self.num_buffers]
            target = self.direct_target(bucket)
            return [(self.group.broadcast(hbuf, src, sub), what + " header"),
                    (self.group.broadcast(target, src, sub), what)], target
        return [(self.group.broadcast(self.bucket_buffer(bucket), src, sub), what)], None

    def receive(self, on_bucket: BucketCallback, on_done: Callable[[], None] | None = None,
                version: int | None = None,
                on_compact: CompactCallback | None = None) -> RefitStats:
        """Receive one refit; `on_bucket(list of (name, tensor))` is called once per bucket
        that arrives whole, `on_compact(bucket index, payload)` once per compact frame (the
        bytes of `self.needs`, placed as `common.shard_plan.Gather` says).

        The tensors are views into a receive buffer that is reused as soon as the callback
        returns: copy anything that must outlive the call. After the first failure (an ABORT
        from the sender, the callback raising, or a `version` other than the one expected)
        the remaining buckets are received but not handed over, and every rank raises at the
        end. `on_done()` runs after the last bucket (also after a failure: it closes what the
        loads opened), before the status exchange, so its failure reaches every rank too.
        """
        stats = RefitStats(-1, len(self.plan.buckets), self.plan.total_bytes, role="receiver")
        t0 = time.perf_counter()
        self.agree_on_needs(self.needs, "refit" if version is None else f"refit v{version}")
        stats.replan_s = time.perf_counter() - t0
        frames = [(b, r) for b in self.plan.buckets for r in self.sharding.routes(b)]
        my_set = self.sharding.my_set()
        stats.need_set = -1 if my_set is None else my_set.index
        posted: dict[int, tuple[list, torch.Tensor | None]] = {}
        error: BaseException | None = None
        for ordinal, (bucket, route) in enumerate(frames):
            self._post_ahead(frames, ordinal, posted)
            works, target = posted.pop(ordinal)
            self.wait_all(works, stats)
            raw, payload = (self.headers[bucket.index % self.num_buffers], target) \
                if bucket.direct and route.gather is None else self.frame(bucket, route, ordinal)
            header = Header.decode(raw)
            error = self._check_header(bucket, route, header, version, stats, error,
                                       first=ordinal == 0)
            if error is not None or (error := self._verify(bucket, header, payload, stats)):
                continue
            if route.gather is None:
                error = self._load(bucket, on_bucket, [self._unpack(bucket, target)], stats)
            elif on_compact is None:
                error = RefitError(f"{self.group.label}: a compact frame of bucket "
                                   f"{bucket.index} arrived, but receive() has no on_compact")
            else:
                error = self._load(bucket, on_compact, [bucket.index, payload], stats)
        if on_done is not None:
            error = self._run_on_done(on_done, stats, error)
        return self.finish(stats, error, t0)

    def _post_ahead(self, frames: list[tuple[Bucket, Route]], ordinal: int, posted: dict) -> None:
        """Post the receives of the frames up to N ahead of `ordinal` (at most one oversize
        tensor beyond the N buffers)."""
        nxt = max(posted, default=ordinal - 1) + 1  # frames before it are all posted
        while nxt < len(frames) and nxt < ordinal + self.num_buffers:
            bucket, route = frames[nxt]
            if bucket.oversize and route.gather is None and posted:
                break
            posted[nxt] = self._post(bucket, route, nxt)
            nxt += 1

    def _check_header(self, bucket: Bucket, route: Route, header: Header, version: int | None,
                      stats: RefitStats, error: BaseException | None,
                      first: bool) -> BaseException | None:
        """The refit's error after this frame's header: the first frame fixes the version (a
        `version` other than it fails the refit), a header out of step raises at once, an
        ABORT fails the refit."""
        if first:
            stats.version = header.version
            if version is not None and header.version != version:
                error = RefitError(f"{self.group.label}: the trainers sent refit "
                                   f"v{header.version}, this receiver expected v{version}")
        expected = Header(bucket.index, len(self.plan.buckets), stats.version, self.plan.digest,
                          need_set=route.set_index, kind=route.kind,
                          payload_bytes=route.payload_bytes(bucket))
        if why := header.mismatch(expected):
            raise RefitError(f"{self.group.label}: protocol out of step at bucket "
                             f"{bucket.index}: {why}; destroy and rebuild the refit group")
        if header.status != STATUS_OK:
            error = error or RefitAborted(f"{self.group.label}: sender rank "
                                          f"{bucket.source_rank} aborted refit "
                                          f"v{header.version}: {header.message}")
        return error

    def _load(self, bucket: Bucket, hand_over: Callable, args: list,
              stats: RefitStats) -> BaseException | None:
        """Hand the bucket's bytes over (`hand_over(*args)`); its failure, named, or None."""
        t1 = time.perf_counter()
        stats.buckets_loaded += 1  # also when it fails: it may have loaded a part
        error = None
        try:
            hand_over(*args)
        except Exception as e:  # noqa: BLE001 - reported to every rank at the end
            first = self.plan.specs[bucket.start].name
            error = RefitError(f"{self.group.label}: loading bucket {bucket.index} "
                               f"({first!r}..) failed: {type(e).__name__}: {e}")
            error.__cause__ = e
        stats.load_s += time.perf_counter() - t1
        return error

    def _unpack(self, bucket: Bucket, target: torch.Tensor | None) -> list:
        """The bucket's (name, tensor) views; an oversize one: its own fresh tensor."""
        if bucket.oversize:
            spec = self.plan.specs[bucket.start]
            return [(spec.name, target.view(spec.dtype).view(spec.shape))]
        return self.layouts[bucket.index].unpack()

    def _verify(self, bucket: Bucket, header: Header, payload: torch.Tensor,
                stats: RefitStats) -> RefitError | None:
        """The received bytes against the sender's checksum (if it sent one): an error naming
        the bucket and its tensors if they differ, before anything of them is loaded."""
        if not header.checksummed:
            return None
        t0 = time.perf_counter()
        got = checksum.compute(payload)
        stats.checksum_s += time.perf_counter() - t0
        if got == header.checksum:
            return None
        specs = self.plan.bucket_specs(bucket)
        return RefitError(f"{self.group.label}: refit v{header.version} bucket {bucket.index}/"
                          f"{len(self.plan.buckets)} arrived corrupted "
                          f"({header.payload_bytes} bytes of "
                          f"{specs[0].name!r}..{specs[-1].name!r}): "
                          f"{checksum.name(self.group.device)} {got:#010x}, the sender's "
                          f"{header.checksum:#010x}; it was not loaded")

    def _run_on_done(self, on_done: Callable[[], None], stats: RefitStats,
                     error: BaseException | None) -> BaseException | None:
        """`on_done()`, timed as loading; the refit's first error (its own, or this one)."""
        t1 = time.perf_counter()
        try:
            on_done()
        except Exception as e:  # noqa: BLE001 - reported to every rank
            if error is None:
                error = RefitError(f"{self.group.label}: finishing refit v{stats.version} "
                                   f"failed: {type(e).__name__}: {e}")
                error.__cause__ = e
        stats.post_s = time.perf_counter() - t1
        stats.load_s += stats.post_s
        return error
