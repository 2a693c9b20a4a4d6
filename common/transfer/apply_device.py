"""The device a receiver applies on: host staging onto it, and the apply's time there.

Host staging: a refit group on the host whose worker applies on a GPU (a CUDA engine refit by
CPU trainers over gloo) copies each frame into one reused buffer there (each bucket's views in
it made once), then loads it. The receiver's buffers are then page-locked, so the copy runs
asynchronously: the host prepares and queues the frame's apply while its bytes cross, and the
device runs the apply right after them instead of idling while the host prepares. Before a
buffer takes the next frame the receiver waits for the copy out of it (`settle`). Device time:
on CUDA the loads return once their copies and processing are queued, so the host's clock
(`RefitStats.load_s`) misses the work itself; an event pair around each frame's staging copy,
its apply and the post-load step measures each on the device's own timeline (the waits on the
wire between frames fall outside every pair).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from common.errors import RefitError
from common.packing import BucketLayout
from common.plan import Bucket, RefitPlan
from common.stats import RefitStats


class ApplyDevice:
    """Where a receiver applies (`device`; None: where the frames arrive), its staging buffer,
    and the device time of the spans `timing()` wraps, by label (CUDA only)."""

    def __init__(self) -> None:
        self.device: torch.device | None = None
        self._staged: torch.Tensor | None = None
        # bucket -> its views in the staging buffer, made while it stays at `_staged_at`
        self._layouts: dict[int, BucketLayout] = {}
        self._staged_at = 0
        self.pairs: list[tuple[str, torch.cuda.Event, torch.cuda.Event]] = []
        self._copied: torch.cuda.Event | None = None  # the last asynchronous staging copy's end

    def buffers(self) -> list[torch.Tensor]:
        """Its reused staging buffer, once there is one."""
        return [] if self._staged is None else [self._staged]

    def stage(self, payload: torch.Tensor, stats: RefitStats) -> torch.Tensor:
        """The frame's bytes in the reused buffer on `device`; as it is if already there.
        From page-locked memory the copy is queued (`settle` before the host buffer is
        written again); from pageable memory it returns once the bytes left the host buffer."""
        if self.device is None or payload.device == self.device:
            return payload
        t0 = time.perf_counter()
        if self._staged is None or self._staged.numel() < payload.numel():
            self._staged = torch.empty(payload.numel(), dtype=torch.uint8, device=self.device)
        staged = self._staged[: payload.numel()]
        pinned = payload.is_pinned()
        with self.timing(self.device, "stage"):
            staged.copy_(payload, non_blocking=pinned)
        if pinned:
            self._copied = torch.cuda.Event()
            self._copied.record(torch.cuda.current_stream(self.device))
        stats.stage_s += time.perf_counter() - t0
        return staged

    def settle(self, timeout_s: float, label: str) -> None:
        """Return once the last asynchronous staging copy has read its host buffer (before
        the receiver lets the next frame land there)."""
        event, self._copied = self._copied, None
        if event is None:
            return
        deadline = time.monotonic() + timeout_s
        while not event.query():
            if time.monotonic() > deadline:
                raise RefitError(f"{label}: a staging copy onto {self.device} did not finish "
                                 f"in {timeout_s:.0f}s (the device hangs?)")
            time.sleep(0)

    def staged_views(self, bucket: Bucket, target: torch.Tensor,
                     plan: RefitPlan) -> list[tuple[str, torch.Tensor]]:
        """The bucket's (name, view) in the staging buffer `target`, the views made once while
        that buffer stays where it is (making every tensor's view per frame cost more than
        the copy)."""
        if self._staged_at != target.data_ptr():  # the buffer moved (grew): all are stale
            self._staged_at, self._layouts = target.data_ptr(), {}
        if (layout := self._layouts.get(bucket.index)) is None:
            layout = self._layouts[bucket.index] = BucketLayout(
                target, plan.specs[bucket.start:bucket.stop], bucket.offsets)
        return layout.unpack()

    @contextmanager
    def timing(self, device: torch.device, label: str) -> Iterator[None]:
        """Time the work queued on `device`'s current stream inside the block as `label`."""
        if device.type != "cuda":
            yield
            return
        stream = torch.cuda.current_stream(device)
        start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
        start.record(stream)
        try:
            yield
        finally:
            end.record(stream)
            self.pairs.append((label, start, end))

    def take(self) -> dict[str, float]:
        """Device seconds per label so far (waits for the last span to end); starts over."""
        total: dict[str, float] = {}
        if self.pairs:
            self.pairs[-1][2].synchronize()
        for label, start, end in self.pairs:
            total[label] = total.get(label, 0.0) + start.elapsed_time(end) / 1e3
        self.pairs = []
        return total
