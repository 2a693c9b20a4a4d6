"""The inference side of a refit (`common.transfer.sender` has the protocol): receive each frame,
check it (`common.transfer.frame_checks`), hand it to the loader; keep a base of what was
received (`common.delta.store`) so delta frames can be rebuilt (`common.delta.frames`) and a
failed refit rolled back."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from common.delta.frames import WHOLE, DeltaReceive, delta_modes, set_keys
from common.delta.store import NO_BASE, FrameStore
from common.errors import RefitError
from common.plan import Bucket, RefitPlan
from common.shard.needs import Needs
from common.shard.replan import Route
from common.stats import RefitStats
from common.timer_slack import fine_timer_slack
from common.transfer.apply_device import ApplyDevice
from common.transfer.endpoint import Endpoint
from common.transfer.frame_checks import checksum_error, first_differing_name, header_error
from common.transfer.handshake import PlanCheck, agree_on_plan
from common.transfer.streams import StreamReceive
from common.wire.bucket_header import Header
from common.wire.transport import Transport

BucketCallback = Callable[[list[tuple[str, torch.Tensor]]], None]
CompactCallback = Callable[[int, torch.Tensor], None]
NO_UNDO = "it keeps no base (RefitConfig.delta and undo_bytes are off)"


class RefitReceiver(Endpoint):
    """Runs on every inference rank: receives each bucket and hands its tensors to a callback."""

    @classmethod
    def setup(cls, group: Transport, plan: RefitPlan | None = None,
              check: PlanCheck | None = None, base_place: torch.device | None = None,
              ) -> RefitReceiver:
        """Join the plan handshake; pass `plan` to insist on it, `check` to vet rank 0's plan
        (a mismatch or a refusal fails the setup on every rank). `base_place`: where the
        base lives (default: the group's device)."""
        if group.is_trainer:
            raise ValueError(f"{group.label} is a training rank; use RefitSender")
        return cls(group, agree_on_plan(group, plan, check), base_place)

    def __init__(self, group: Transport, plan: RefitPlan,
                 base_place: torch.device | None = None) -> None:
        super().__init__(group, plan)
        # What this worker reads of each bucket (`common.shard.needs`) once it knows (a learned
        # load map); reported at each refit's start. None: every byte.
        self.needs: Needs | None = None
        cfg = plan.config
        self.base = FrameStore(base_place or group.device, cfg.undo_bytes) \
            if cfg.delta or cfg.undo_bytes else None
        self._scratch: list[torch.Tensor] = []
        self.applied: list[tuple[Bucket, Route, int]] = []  # this refit's frames handed over
        self.undo_refusal: str | None = NO_UNDO  # why the last failed refit cannot roll back
        # where the worker applies (host staging onto it), and the apply's device time there
        self.apply = ApplyDevice()

    def stage_onto(self, device: torch.device) -> None:
        """Apply on `device` (a GPU worker in a host group): each frame is staged there, from
        page-locked receive buffers (`ApplyDevice`)."""
        self.apply.device = device
        if device.type == "cuda" and not self.pinned:
            self.make_buffers(pinned=True)

    def keep_base_of(self, old: RefitReceiver | None) -> None:
        """Carry `old`'s base over (a new group for the same plan: the next refit can still
        be a delta, and a failure of it rolled back)."""
        if old is not None and old.base is not None and self.base is not None \
                and old.plan.digest == self.plan.digest:
            self.base = old.base

    def owns(self, tensor: torch.Tensor) -> bool:
        """Whether `tensor` is a view into one of this receiver's reusable buffers."""
        ptr = tensor.untyped_storage().data_ptr()
        buffers = [*self.buffers, *(b for c in self.compact.values() for b in c.buffers),
                   *self.apply.buffers()]
        return any(ptr == b.untyped_storage().data_ptr() for b in buffers)

    def receive(self, on_bucket: BucketCallback, on_done: Callable[[], str | None] | None = None,
                version: int | None = None, on_compact: CompactCallback | None = None,
                verify: bool = False) -> RefitStats:
        """Receive one refit; `on_bucket(list of (name, tensor))` is called once per bucket
        that arrives whole, `on_compact(bucket index, payload)` once per compact frame (the
        bytes of `self.needs`, placed as `common.shard.plan.Gather` says).

        The tensors are views into a receive buffer that is reused as soon as the callback
        returns: copy anything that must outlive the call. After the first failure (an ABORT
        from the sender, the callback raising, or a `version` other than the one expected)
        the remaining buckets are received but not handed over, and every rank raises at the
        end (then `roll_back` can re-apply the last complete version). `on_done()` runs after
        the last bucket (also after a failure: it closes what the loads opened), before the
        status exchange, so its failure reaches every rank too; what it returns (a hash of the
        bytes the worker loaded) goes to every rank in the status record. `verify`: the trainers
        resend the version this worker holds; it takes whole frames and fails the refit if
        a byte differs from its base. On CUDA the thread's timer slack is cut meanwhile
        (`common.timer_slack`): the waits' sleeps end on time.
        """
        with fine_timer_slack(self.group.device.type == "cuda"):
            return self._receive(on_bucket, on_done, version, on_compact, verify)

    def _receive(self, on_bucket: BucketCallback, on_done: Callable[[], str | None] | None,
                 version: int | None, on_compact: CompactCallback | None,
                 verify: bool) -> RefitStats:
        stats = RefitStats(-1, len(self.plan.buckets), self.plan.total_bytes, role="receiver")
        t0 = time.perf_counter()
        self.applied, self._verify, self.undo_refusal = [], verify, None
        self.apply.take()  # a roll-back's spans are not this refit's
        what = "refit" if version is None else f"refit v{version}"
        self.agree_on_needs(self.needs, what)
        stats.replan_s = time.perf_counter() - t0
        frames = [(b, r) for b in self.plan.buckets for r in self.sharding.routes(b)]
        my_set = self.sharding.my_set()
        stats.need_set = -1 if my_set is None else my_set.index
        base_version = self._agree_on_bases(stats.need_set, verify, what)

        def hand_over(bucket: Bucket, route: Route, payload: torch.Tensor,
                      staged: bool) -> BaseException | None:
            return self._hand_over(bucket, route, payload, staged, on_bucket, on_compact,
                                   stats)

        def check(bucket: Bucket, route: Route, header: Header, error: BaseException | None,
                  first: bool) -> BaseException | None:
            return header_error(self.group.label, self.plan, bucket, route, header, version,
                                stats, error, first)

        try:  # whatever fails (the group too), the base learns of it
            if base_version is not None:
                error = DeltaReceive(self, frames, base_version, stats).run(hand_over, check)
            else:
                error = StreamReceive(self, frames, stats).run(check, hand_over)
            if on_done is not None:
                error = self._run_on_done(on_done, stats, error)
            stats = self.finish(stats, error, t0)
        except BaseException:
            self._failed()
            raise
        if self.base is not None and not verify:
            self.base.commit(stats.version)
        return stats

    def _agree_on_bases(self, my_set: int, verify: bool, what: str) -> int | None:
        """Open this refit in the base; the base version its frames go on, if in delta
        mode (a verification asks for whole frames)."""
        if self.base is None:
            return None
        key = set_keys(self)[my_set]
        self.base.begin(key, self._compact_from_whole(my_set)
                        if self.base.key == WHOLE else None)
        held = self.base.holds(key)
        if not self.plan.config.delta:
            return None
        report = NO_BASE if held is None or verify else held
        return delta_modes(self, {my_set: report}, what).get(my_set)

    def _compact_from_whole(self, my_set: int) -> Callable:
        """Makes this set's compact frame of a bucket from the whole bucket's bytes: the
        first refit after a worker learned its map keeps its base (and so its rollback)."""
        routes = {b.index: r for b in self.plan.buckets for r in self.sharding.routes(b)
                  if r.set_index == my_set}

        def derive(index: int, whole: torch.Tensor) -> torch.Tensor | None:
            route = routes.get(index)
            if route is None:  # this set reads nothing of the bucket
                return None
            return whole if route.gather is None else route.gather.take(
                self.plan.buckets[index], whole)

        return derive

    def post_frame(self, bucket: Bucket, route: Route,
                   slot: int) -> tuple[list, torch.Tensor | None]:
        """Post the receive of one frame into `slot`; its works and, for a direct bucket,
        the tensor its bytes land in."""
        what = f"refit bucket {bucket.index}/{len(self.plan.buckets)}"
        if self.schedule.concurrent:
            what += f" from rank {bucket.source_rank}"
        src, sub = bucket.source_rank, route.sub
        self.apply.settle(self.group.timeout_s, self.group.label)  # its buffer is free again
        if route.gather is not None:
            frame = self.frame(bucket, route, slot)[0]
            return [(self.group.broadcast(frame, src, sub), what)], None
        if bucket.direct:
            target = self.direct_target(bucket)
            return [(self.group.broadcast(self.headers[slot], src, sub), what + " header"),
                    (self.group.broadcast(target, src, sub), what)], target
        return [(self.group.broadcast(self.bucket_buffer(bucket), src, sub), what)], None

    def frame_payload(self, bucket: Bucket, route: Route, ordinal: int) -> torch.Tensor:
        """Where frame `ordinal`'s whole payload goes: its buffer's payload region, or a
        tensor of its own (oversize)."""
        if route.gather is not None:
            return self.compact[route.set_index].payload(ordinal, route.gather)
        return self.direct_target(bucket) if bucket.oversize else self.payload(bucket)

    def delta_buffers(self) -> list[torch.Tensor]:
        """Two buffers the delta payloads land in, as large as this rank's largest frame."""
        size = max([self.plan.buffer_bytes, *(c.buffers[0].numel() for c in
                                              self.compact.values())])
        if not self._scratch or self._scratch[0].numel() < size:
            self._scratch = [torch.empty(size, dtype=torch.uint8, device=self.group.device)
                             for _ in range(2)]
        return self._scratch

    def first_name(self, bucket: Bucket) -> str:
        return self.plan.specs[bucket.start].name

    def _hand_over(self, bucket: Bucket, route: Route, payload: torch.Tensor, staged: bool,
                   on_bucket: BucketCallback, on_compact: CompactCallback | None,
                   stats: RefitStats) -> BaseException | None:
        """Record the frame in the base (compare it, verifying), then load it."""
        if self.base is not None and not staged:
            held = self.base.base(bucket.index)
            if not self._verify:
                self.base.stage_whole(bucket.index, payload)
            elif held is not None and (name := first_differing_name(self.plan, bucket, route,
                                                                    held, payload)):
                return RefitError(f"{self.group.label}: verify v{stats.version}: bucket "
                                  f"{bucket.index}: {name} differs from the bytes this "
                                  f"worker holds; it was not loaded")
        self.applied.append((bucket, route, len(self.applied)))
        return self._load(bucket, route, payload, on_bucket, on_compact, stats)

    def _load(self, bucket: Bucket, route: Route, payload: torch.Tensor,
              on_bucket: BucketCallback, on_compact: CompactCallback | None,
              stats: RefitStats) -> BaseException | None:
        """Hand the frame's bytes over; its failure, named, or None."""
        t1 = time.perf_counter()
        stats.buckets_loaded += 1  # also when it fails: it may have loaded a part
        error = None
        try:
            payload = self.apply.stage(payload, stats)
            with self.apply.timing(payload.device, "load"):
                if route.gather is None:
                    on_bucket(self._unpack(bucket, payload))
                elif on_compact is None:
                    raise RefitError(f"a compact frame of bucket {bucket.index} arrived, but "
                                     f"receive() has no on_compact")
                else:
                    on_compact(bucket.index, payload)
        except Exception as e:  # noqa: BLE001 - reported to every rank at the end
            error = RefitError(f"{self.group.label}: loading bucket {bucket.index} "
                               f"({self.first_name(bucket)!r}..) failed: "
                               f"{type(e).__name__}: {e}")
            error.__cause__ = e
        stats.load_s += time.perf_counter() - t1
        return error

    def _failed(self) -> None:
        """The refit failed somewhere: remember whether it can be rolled back, drop what it
        staged."""
        if self.base is None:
            self.undo_refusal = NO_UNDO
            return
        self.undo_refusal = None if self._verify else self.base.undoable()
        self.base.abort()

    def roll_back(self, on_bucket: BucketCallback,
                  on_compact: CompactCallback | None = None) -> int:
        """After a failed refit: hand every frame it applied over again from the base (the
        last complete version); returns how many. Raises if it cannot (the reason)."""
        if not self.applied:  # nothing of it reached the loaders here: nothing to undo
            return 0
        if self.undo_refusal is not None:
            raise RefitError(f"{self.group.label}: cannot roll back: {self.undo_refusal}")
        stats = RefitStats(-1, 0, 0, role="receiver")
        for bucket, route, ordinal in self.applied:
            payload = self.frame_payload(bucket, route, ordinal)
            self.apply.settle(self.group.timeout_s, self.group.label)
            payload.copy_(self.base.base(bucket.index))
            if error := self._load(bucket, route, payload, on_bucket, on_compact, stats):
                raise error
        return len(self.applied)

    def _unpack(self, bucket: Bucket, target: torch.Tensor) -> list:
        """The bucket's (name, tensor) views; an oversize one: its own fresh tensor."""
        if bucket.oversize:
            spec = self.plan.specs[bucket.start]
            return [(spec.name, target.view(spec.dtype).view(spec.shape))]
        if target.device != self.group.device:  # staged onto the apply device
            return self.apply.staged_views(bucket, target, self.plan)
        return self.layouts[bucket.index].unpack()

    def verify_bytes(self, bucket: Bucket, header: Header, payload: torch.Tensor,
                     expected: int, stats: RefitStats,
                     what: str = "arrived corrupted") -> RefitError | None:
        """`payload` against the sender's checksum `expected` (if it sent one): an error
        naming the bucket and its tensors if they differ, before anything of them is
        loaded (`frame_checks.checksum_error`)."""
        return checksum_error(self.group, self.plan, bucket, header, payload, expected, stats,
                              what)

    def _run_on_done(self, on_done: Callable[[], str | None], stats: RefitStats,
                     error: BaseException | None) -> BaseException | None:
        """`on_done()`, timed as loading; the refit's first error (its own, or this one)."""
        t1 = time.perf_counter()
        try:
            with self.apply.timing(self.apply.device or self.group.device, "post"):
                stats.loaded_hash = on_done() or ""
        except Exception as e:  # noqa: BLE001 - reported to every rank
            if error is None:
                error = RefitError(f"{self.group.label}: finishing refit v{stats.version} "
                                   f"failed: {type(e).__name__}: {e}")
                error.__cause__ = e
        stats.post_s = time.perf_counter() - t1
        stats.load_s += stats.post_s
        spans = self.apply.take()
        stats.device_stage_s = spans.pop("stage", 0.0)
        stats.device_apply_s, stats.device_post_s = sum(spans.values()), spans.get("post", 0.0)
        return error
