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
    """Sums the device time of the spans `timing()` wraps (CUDA only; elsewhere 0)."""

    def __init__(self) -> None:
        self.pairs: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []

    @contextmanager
    def timing(self, device: torch.device) -> Iterator[None]:
        """Time the work queued on `device`'s current stream inside the block."""
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
            self.pairs.append((start, end))

    def take_s(self) -> float:
        """The spans' device seconds so far (waits for the last to end), and start over."""
        if not self.pairs:
            return 0.0
        self.pairs[-1][1].synchronize()
        total = sum(start.elapsed_time(end) for start, end in self.pairs) / 1e3
        self.pairs = []
        return total
