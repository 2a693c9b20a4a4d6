"""The device a receiver applies on: host staging onto it, and the apply's time there.

Host staging: a refit group on the host whose worker applies on a GPU (a CUDA engine refit by
CPU trainers over gloo) copies each frame into one reused buffer there (each bucket's views in
it made once), then loads it. Device time: on CUDA the loads return once their copies and
processing are queued, so the host's clock (`RefitStats.load_s`) misses the work itself; an
event pair around each frame's apply and the post-load step measures it on the device's own
timeline (the staging copy before it and the waits on the wire between frames fall outside
every pair).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch

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

    def buffers(self) -> list[torch.Tensor]:
        """Its reused staging buffer, once there is one."""
        return [] if self._staged is None else [self._staged]

    def stage(self, payload: torch.Tensor, stats: RefitStats) -> torch.Tensor:
        """The frame's bytes in the reused buffer on `device` (a copy from pageable host
        memory: it returns once the bytes left the host buffer); as it is if already there."""
        if self.device is None or payload.device == self.device:
            return payload
        t0 = time.perf_counter()
        if self._staged is None or self._staged.numel() < payload.numel():
            self._staged = torch.empty(payload.numel(), dtype=torch.uint8, device=self.device)
        staged = self._staged[: payload.numel()]
        staged.copy_(payload)
        stats.stage_s += time.perf_counter() - t0
        return staged

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
