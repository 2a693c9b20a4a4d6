"""The device time of a receiver's apply on a GPU.

On CUDA the loads return once their copies and processing are queued, so the host's clock
(`RefitStats.load_s`) misses the work itself. An event pair around each frame's apply and the
post-load step measures it on the device's own timeline: the staging copy before it and the
waits on the wire between frames fall outside every pair.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch


class ApplyClock:
    """Sums the device time of the spans `timing()` wraps, by label (CUDA only)."""

    def __init__(self) -> None:
        self.pairs: list[tuple[str, torch.cuda.Event, torch.cuda.Event]] = []

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
