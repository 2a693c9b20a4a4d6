"""What the one-launch CUDA kernels share: an int64 table on the device that their launches read
(uploaded only when it changes), the current stream's object made once, and launches captured
as a CUDA graph and replayed (a replay costs a fraction of a Triton launch's host time)."""

from __future__ import annotations

import logging
from collections.abc import Callable

import numpy as np
import torch

log = logging.getLogger(__name__)
_STREAMS: dict[tuple[int, int], torch.cuda.Stream] = {}  # `current_stream`'s objects


def current_stream(device_index: int) -> torch.cuda.Stream:
    """The current stream of device `device_index`, its Python object made once per stream
    (`torch.cuda.current_stream()` builds one per call, a share of a bucket's host time)."""
    stream_id, index, kind = torch._C._cuda_getCurrentStream(device_index)
    if (stream := _STREAMS.get((stream_id, index))) is None:
        stream = _STREAMS[stream_id, index] = torch.cuda.Stream(
            stream_id=stream_id, device_index=index, device_type=kind)
    return stream


class DeviceTable:
    """`size` int64 words on a CUDA device that kernels read when they run (`words`), written
    through a pinned staging table with a non-blocking upload on the current stream: a pageable
    upload would wait for the stream (the kernels queued before it), so the host could not
    prepare the next launch meanwhile. `stage` uploads only a table that differs from the last
    one: a source whose addresses stay put uploads them once, and a graph of its launches holds
    the kernels alone."""

    def __init__(self, size: int, device: torch.device) -> None:
        self.words = torch.empty(size, dtype=torch.int64, device=device)
        self.device_index = device.index if device.index is not None else 0
        self._host = torch.empty(size, dtype=torch.int64, pin_memory=True)
        self._host_view = self._host.numpy()
        self._staged: bytes | None = None  # the device table's bytes
        self._uploaded = torch.cuda.Event()  # the last upload has read the staging table
        self.uploads = 0  # tables that went up (a changed one each)

    def stage(self, table: np.ndarray, key: bytes) -> None:
        """Make `table` (`key`: its bytes) what the next launches read: written into the
        staging table once the last upload has read it, then uploaded behind the launches
        already queued (which read the last table). Equal to the last: nothing, no wait."""
        if key != self._staged:
            self._uploaded.synchronize()
            self._host_view[:] = table
            self._staged = key
            self.words.copy_(self._host, non_blocking=True)
            self.uploads += 1
            self._uploaded.record(current_stream(self.device_index))


def capture_graph(launch: Callable[[], None], what: str) -> torch.cuda.CUDAGraph | None:
    """`launch` (kernels reading their tables when they run) as a CUDA graph, captured on a
    stream of its own (capture never runs on a live stream); None where capture fails: the
    launches stay eager."""
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.stream(torch.cuda.Stream()):
            graph.capture_begin(capture_error_mode="thread_local")
            try:
                launch()
            finally:
                graph.capture_end()
    except RuntimeError as e:
        log.warning("%s: CUDA graph capture failed, launching eagerly: %s", what, e)
        return None
    return graph


def replay_or_launch(graphs: dict, key: object, launch: Callable[[], None], what: str,
                     limit: int | None = None) -> None:
    """Replay `graphs[key]`; without one, `launch` eagerly (the first launch also compiles
    its kernels) and capture it for the next time (a failed capture is remembered as None:
    eager from then on; at most `limit` graphs)."""
    if (graph := graphs.get(key)) is not None:
        graph.replay()
        return
    launch()
    if key not in graphs and (limit is None or len(graphs) < limit):
        graphs[key] = capture_graph(launch, what)
