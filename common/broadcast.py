"""Coalescing, multi-buffered broadcaster: one collective per bucket, N buffers in rotation.

Protocol (identical collective sequence on every rank, whatever fails, so nothing can hang):
  setup:   rank 0 broadcasts the plan; every rank checks it against its own (digest) and all
           ranks learn of any mismatch through one all-gather.
  refit:   per bucket one broadcast of [header | payload] from the bucket's source rank (a
           direct bucket, one large tensor: a header broadcast, then its bytes straight from the
           tensor into the receive buffer, or into a tensor of its own when oversize);
           then one all-gather of every rank's status, so every rank learns whether the refit
           landed everywhere.
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
from collections.abc import Callable, Iterator, Sequence

import torch

from common.bucket_check import BucketChecker
from common.errors import (
    RefitAborted,
    RefitCommError,
    RefitError,
    TensorMismatchError,
)
from common.handshake import PlanCheck, agree_on_plan, exchange_status
from common.kernels import native
from common.packing import BucketLayout, byte_view
from common.plan import Bucket, RefitPlan, align_up
from common.source import WeightSource
from common.stats import RefitStats
from common.wire import checksum
from common.wire.bucket_header import HEADER_BYTES, STATUS_ABORT, STATUS_OK, Header
from common.wire.transport import Transport

log = logging.getLogger(__name__)
BucketCallback = Callable[[list[tuple[str, torch.Tensor]]], None]


class _Endpoint:
    """Buffers and the end-of-refit status exchange shared by sender and receiver."""

    def __init__(self, group: Transport, plan: RefitPlan) -> None:
        self.group, self.plan = group, plan
        self.num_buffers = plan.config.num_buffers
        self.checksums = plan.config.checksum and checksum.supported(group.device)
        self.payload_start = align_up(HEADER_BYTES, plan.config.alignment)
        size = self.payload_start + plan.buffer_bytes
        dev = group.device
        self.buffers = [torch.empty(size, dtype=torch.uint8, device=dev)
                        for _ in range(self.num_buffers)]
        self.headers = [torch.empty(HEADER_BYTES, dtype=torch.uint8, device=dev)
                        for _ in range(self.num_buffers)]
        # Each bucket always lands in the same buffer: its views are made once, here.
        self.layouts = {
            b.index: BucketLayout(self.bucket_buffer(b)[self.payload_start :],
                                  plan.bucket_specs(b), b.offsets)
            for b in plan.buckets if not b.oversize
        }

    def header(self, bucket: Bucket, version: int, error: BaseException | None) -> Header:
        if error is None:
            return Header(bucket.index, len(self.plan.buckets), version, self.plan.digest,
                          checksummed=self.checksums)
        return Header(bucket.index, len(self.plan.buckets), version, self.plan.digest,
                      STATUS_ABORT, f"{type(error).__name__}: {error}")

    def direct_target(self, bucket: Bucket) -> torch.Tensor:
        """Where a direct bucket's bytes land: the payload region of its buffer, or a fresh
        tensor when it is larger than a buffer (oversize)."""
        if bucket.oversize:
            return torch.empty(bucket.nbytes, dtype=torch.uint8, device=self.group.device)
        return self.bucket_buffer(bucket)[self.payload_start :]

    def bucket_buffer(self, bucket: Bucket) -> torch.Tensor:
        return self.buffers[bucket.index % self.num_buffers][: self.payload_start + bucket.nbytes]

    def payload(self, bucket: Bucket) -> torch.Tensor:
        """A packed bucket's bytes in its buffer (after the header)."""
        return self.bucket_buffer(bucket)[self.payload_start:]

    def wait_all(self, works: Sequence[tuple[object, str]], stats: RefitStats) -> None:
        t0 = time.perf_counter()
        for work, what in works:
            self.group.wait(work, what)
        stats.wait_s += time.perf_counter() - t0

    def finish(self, stats: RefitStats, error: BaseException | None, t0: float) -> RefitStats:
        """Exchange every rank's status; raise on every rank if any rank failed."""
        return exchange_status(self.group, stats, error, t0)


class RefitSender(_Endpoint):
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

    def header_table(self, version: int) -> torch.Tensor:
        """Every bucket's OK header for this refit, moved to the device in one copy (a copy per
        bucket costs a synchronous host-to-device transfer each on CUDA)."""
        raw = b"".join(self.header(b, version, None).encode_bytes() for b in self.plan.buckets)
        table = torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(-1, HEADER_BYTES)
        return table.to(self.group.device)

    def refit(self, source: WeightSource, version: int) -> RefitStats:
        """Send one complete set of weights, tagged `version`; returns this rank's stats."""
        plan, group = self.plan, self.group
        stats = RefitStats(version, len(plan.buckets), plan.total_bytes)
        t0 = time.perf_counter()
        it: Iterator | None = iter(source.iter_tensors(plan))
        error: BaseException | None = None
        pending: list[list] = [[] for _ in range(self.num_buffers)]
        held: list[torch.Tensor | None] = [None] * self.num_buffers
        table = self.header_table(version)
        # A failed collective kills the refit group; this rank then stops using it but still
        # drains the weight source, so its gathers on the training groups stay in step with
        # the other training ranks (they reach the same state at their own next wait).
        dead: RefitCommError | None = None
        for bucket in plan.buckets:
            slot = bucket.index % self.num_buffers
            # An oversize bucket starts only when nothing else is in flight: at most one
            # oversize tensor is alive beyond the N buffers.
            for s in range(self.num_buffers) if bucket.oversize else [slot]:
                dead = dead or self._settle(pending[s], stats)
                pending[s], held[s] = [], None
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
            pending[slot], held[slot], error = self._send(bucket, version, tensors, ptrs, error,
                                                          table)
            stats.pack_s += time.perf_counter() - t1
            del tensors
        for s in range(self.num_buffers):
            dead = dead or self._settle(pending[s], stats)
        if dead is not None:
            raise dead  # no status exchange over a dead group
        if it is not None and error is None and next(it, None) is not None:
            error = RefitError(f"{group.label}: weight source yields more tensors than the plan's "
                               f"{len(plan.specs)}")
        return self.finish(stats, error, t0)

    def _send(self, bucket: Bucket, version: int, tensors: list, ptrs, error,
              table: torch.Tensor) -> tuple[list, torch.Tensor | None, BaseException | None]:
        """Pack (on its source) and start one bucket's broadcasts; returns the works, the
        tensor they hold (alive until waited) and the refit's error so far."""
        group, slot = self.group, bucket.index % self.num_buffers
        is_src, src = group.rank == bucket.source_rank, bucket.source_rank
        what = f"refit v{version} bucket {bucket.index}/{len(self.plan.buckets)}"
        payload = None
        if is_src and error is None:
            try:  # a failing pack (device, memory) becomes an ABORT like any other error
                if bucket.direct:
                    payload = byte_view(tensors[0].contiguous())
                else:
                    self.layouts[bucket.index].pack(tensors, ptrs)
            except Exception as e:  # noqa: BLE001 - reported to every rank
                error = RefitError(f"{group.label}: packing {what} failed: {e}")
        # The header leads the bucket's own buffer, or has a buffer of its own (direct).
        wire = self.headers[slot] if bucket.direct else self.bucket_buffer(bucket)
        if is_src and error is not None:
            wire[:HEADER_BYTES].copy_(self.header(bucket, version, error).encode())
        elif is_src and bucket.direct:
            wire = table[bucket.index]
        elif is_src:
            wire[:HEADER_BYTES].copy_(table[bucket.index], non_blocking=True)
        if is_src and error is None and self.checksums:
            checksum.stamp(wire, payload if bucket.direct else self.payload(bucket))
        if not bucket.direct:
            return [(group.broadcast(wire, src), what)], None, error
        if payload is None:  # not the source, or aborting: bytes to receive / discard
            payload = self.direct_target(bucket)
        return [(group.broadcast(wire, src), what + " header"),
                (group.broadcast(payload, src), what)], payload, error

    def _settle(self, works: list, stats: RefitStats) -> RefitCommError | None:
        """Wait for `works`; a failure is returned (the group is dead), not raised."""
        try:
            self.wait_all(works, stats)
        except RefitCommError as e:
            return e
        return None


class RefitReceiver(_Endpoint):
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

    def owns(self, tensor: torch.Tensor) -> bool:
        """Whether `tensor` is a view into one of this receiver's reusable buffers."""
        ptr = tensor.untyped_storage().data_ptr()
        return any(ptr == b.untyped_storage().data_ptr() for b in self.buffers)

    def _post(self, bucket: Bucket) -> tuple[list, torch.Tensor | None]:
        what = f"refit bucket {bucket.index}/{len(self.plan.buckets)}"
        src = bucket.source_rank
        if bucket.direct:
            hbuf = self.headers[bucket.index % self.num_buffers]
            target = self.direct_target(bucket)
            return [(self.group.broadcast(hbuf, src), what + " header"),
                    (self.group.broadcast(target, src), what)], target
        return [(self.group.broadcast(self.bucket_buffer(bucket), src), what)], None

    def receive(self, on_bucket: BucketCallback, on_done: Callable[[], None] | None = None,
                version: int | None = None) -> RefitStats:
        """Receive one refit; `on_bucket(list of (name, tensor))` is called once per bucket.

        The tensors are views into a receive buffer that is reused as soon as the callback
        returns: copy anything that must outlive the call. After the first failure (an ABORT
        from the sender, the callback raising, or a `version` other than the one expected)
        the remaining buckets are received but not handed over, and every rank raises at the
        end. `on_done()` runs after the last bucket (also after a failure: it closes what the
        loads opened), before the status exchange, so its failure reaches every rank too.
        """
        buckets = self.plan.buckets
        stats = RefitStats(-1, len(buckets), self.plan.total_bytes, role="receiver")
        t0 = time.perf_counter()
        posted: dict[int, tuple[list, torch.Tensor | None]] = {}
        error: BaseException | None = None
        for bucket in buckets:
            self._post_ahead(bucket, posted)
            works, target = posted.pop(bucket.index)
            self.wait_all(works, stats)
            raw = self.headers[bucket.index % self.num_buffers] if bucket.direct \
                else self.bucket_buffer(bucket)
            header = Header.decode(raw)
            error = self._check_header(bucket, header, version, stats, error)
            if error is not None or (error := self._verify(bucket, header, target, stats)):
                continue
            error = self._load(bucket, target, on_bucket, stats)
        if on_done is not None:
            error = self._run_on_done(on_done, stats, error)
        return self.finish(stats, error, t0)

    def _post_ahead(self, bucket: Bucket, posted: dict) -> None:
        """Post the receives of the buckets up to N ahead of `bucket` (at most one oversize
        tensor beyond the N buffers)."""
        buckets = self.plan.buckets
        nxt = max(posted, default=bucket.index - 1) + 1  # buckets before it are all posted
        while nxt < len(buckets) and nxt < bucket.index + self.num_buffers:
            if buckets[nxt].oversize and posted:
                break
            posted[nxt] = self._post(buckets[nxt])
            nxt += 1

    def _check_header(self, bucket: Bucket, header: Header, version: int | None,
                      stats: RefitStats, error: BaseException | None) -> BaseException | None:
        """The refit's error after this bucket's header: the first bucket fixes the version
        (a `version` other than it fails the refit), a header out of step raises at once, an
        ABORT fails the refit."""
        if bucket.index == 0:
            stats.version = header.version
            if version is not None and header.version != version:
                error = RefitError(f"{self.group.label}: the trainers sent refit "
                                   f"v{header.version}, this receiver expected v{version}")
        expected = Header(bucket.index, len(self.plan.buckets), stats.version, self.plan.digest)
        if why := header.mismatch(expected):
            raise RefitError(f"{self.group.label}: protocol out of step at bucket "
                             f"{bucket.index}: {why}; destroy and rebuild the refit group")
        if header.status != STATUS_OK:
            error = error or RefitAborted(f"{self.group.label}: sender rank "
                                          f"{bucket.source_rank} aborted refit "
                                          f"v{header.version}: {header.message}")
        return error

    def _load(self, bucket: Bucket, target: torch.Tensor | None, on_bucket: BucketCallback,
              stats: RefitStats) -> BaseException | None:
        """Hand the bucket's tensors to `on_bucket`; its failure, named, or None."""
        tensors = self._unpack(bucket, target)
        t1 = time.perf_counter()
        stats.buckets_loaded += 1  # also when it fails: it may have loaded a part
        error = None
        try:
            on_bucket(tensors)
        except Exception as e:  # noqa: BLE001 - reported to every rank at the end
            error = RefitError(f"{self.group.label}: loading bucket {bucket.index} "
                               f"({tensors[0][0]!r}..) failed: {type(e).__name__}: {e}")
            error.__cause__ = e
        stats.load_s += time.perf_counter() - t1
        return error

    def _unpack(self, bucket: Bucket, target: torch.Tensor | None) -> list:
        """The bucket's (name, tensor) views; an oversize one: its own fresh tensor."""
        if bucket.oversize:
            spec = self.plan.specs[bucket.start]
            return [(spec.name, target.view(spec.dtype).view(spec.shape))]
        return self.layouts[bucket.index].unpack()

    def _verify(self, bucket: Bucket, header: Header, target: torch.Tensor | None,
                stats: RefitStats) -> RefitError | None:
        """The received bytes against the sender's checksum (if it sent one): an error naming
        the bucket and its tensors if they differ, before anything of them is loaded."""
        if not header.checksummed:
            return None
        t0 = time.perf_counter()
        got = checksum.compute(target if bucket.direct else self.payload(bucket))
        stats.checksum_s += time.perf_counter() - t0
        if got == header.checksum:
            return None
        specs = self.plan.bucket_specs(bucket)
        return RefitError(f"{self.group.label}: refit v{header.version} bucket {bucket.index}/"
                          f"{len(self.plan.buckets)} arrived corrupted ({bucket.nbytes} bytes of "
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
