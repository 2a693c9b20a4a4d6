"""Whole frames sent as one CUDA graph replay per bucket: pack, header, checksum, broadcast.

On CUDA a bucket's sender time is host time: the pack kernels' graph replay and its event, the
header's device copy, ProcessGroupNCCL's broadcast call and its Work, tens of microseconds each
against tens of microseconds of device work for a 64 MiB bucket. Captured once per bucket, all of
it is one replay: the pack kernels read the sources' addresses from their pinned staging tables
(written only when the addresses change: a source whose tensors stay put stages them once),
one more kernel copies the frame's header from the refit's header table (the row's address is
staged like a source's), the checksum (when on) is stamped on the device, and the broadcast was
captured on the capturing stream. A replay is waited for through an event recorded behind it,
polled with the refit timeout like a collective's Work; a dead peer leaves the replayed broadcast
waiting on the GPU until the timeout aborts the communicator, as with an eager one. The
receivers' eager broadcasts pair with the replayed ones: every rank keeps the plan's order.

Only whole frames from their source go this way (not a direct bucket, a compact frame, a delta
or an ABORT); a bucket whose capture failed, or whose sources need another kernel variant than
the captured one, goes eagerly; where the broadcast cannot be captured, the graph holds the rest
and the broadcast follows each replay eagerly. `RefitConfig.graph_send` turns it on.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from common.kernels.pack_kernel import BufferKernel, current_stream
from common.packing import BucketLayout, kernel_tables
from common.wire import checksum
from common.wire.bucket_header import HEADER_BYTES
from common.wire.transport import Transport

log = logging.getLogger(__name__)


class ReplayWork:
    """A replayed frame's completion, polled by `Transport.wait` as a collective's Work is."""

    __slots__ = ("event",)

    def __init__(self, event: torch.cuda.Event) -> None:
        self.event = event

    def is_completed(self) -> bool:
        return self.event.query()

    def wait(self) -> None:
        """Nothing to raise: a replay reports no error of its own (a stuck one times out)."""


class _Captured:
    """One bucket's graph, the kernels whose staging tables it reads, and whether it holds the
    broadcast too (else the frame's broadcast is started eagerly after the replay)."""

    __slots__ = ("graph", "kernels", "header", "event", "nbytes", "broadcasts", "checked",
                 "tables")

    def __init__(self, graph: torch.cuda.CUDAGraph, kernels: list, header: BufferKernel,
                 event: torch.cuda.Event, nbytes: int, broadcasts: bool) -> None:
        self.graph, self.kernels, self.header = graph, kernels, header
        self.event, self.nbytes, self.broadcasts = event, nbytes, broadcasts
        # the last sources' addresses found fit for the graph (bytes) and each kernel's table
        self.checked: bytes | None = None
        self.tables: list[tuple[BufferKernel, np.ndarray, bytes]] = []


class GraphFrames:
    """A trainer's captured whole frames, one graph per bucket it sources (made on the bucket's
    first send). Where the transport's broadcast cannot be captured, the graphs hold the pack,
    header and checksum, and the broadcast goes eagerly after each replay."""

    def __init__(self, group: Transport, checksums: bool) -> None:
        self.group, self.checksums = group, checksums
        self.device_index = group.device.index
        self._graphs: dict[int, _Captured | None] = {}
        self.failure: str | None = None  # why capturing the broadcast failed (logged once)
        self.replays = 0  # frames sent by replay so far
        # One memory pool for every bucket's graph (the checksum's scratch): the replays run
        # one after another on one stream, so they can share it.
        self._pool: tuple | None = None

    @property
    def captured(self) -> int:
        """How many buckets go by replay."""
        return sum(entry is not None for entry in self._graphs.values())

    def send(self, index: int, layout: BucketLayout, wire: torch.Tensor, payload: torch.Tensor,
             ptrs: np.ndarray, header_address: int) -> object | None:
        """Replay bucket `index`'s frame (its `layout`, [header | payload] buffer `wire`) for
        sources at `ptrs` and the header row at `header_address`; returns what to wait for,
        or None: send it eagerly."""
        if (entry := self._graphs.get(index, _Captured)) is _Captured:
            entry = self._graphs[index] = self._capture(layout, wire, payload)
        if entry is None or header_address % 16:
            return None
        if (key := ptrs.tobytes()) != entry.checked:  # the tables are a function of `ptrs`
            tables = kernel_tables(entry.kernels, ptrs)
            if tables is None or any(k.vec_for(bits) != k.vec for k, _, bits in tables):
                return None  # sources aligned for another variant than the captured one
            entry.checked = key
            entry.tables = [(k, table.copy(), table.tobytes()) for k, table, _ in tables]
        for kernel, table, table_key in entry.tables:  # waits for the last replay if changed
            kernel.stage(table, table_key)
        header = np.array([header_address], np.int64)
        entry.header.stage(header, header.tobytes())
        if torch._C._cuda_getDevice() == self.device_index:
            entry.graph.replay()
        else:
            with torch.cuda.device(self.device_index):
                entry.graph.replay()
        entry.event.record(current_stream(self.device_index))
        self.replays += 1
        if not entry.broadcasts:
            return self.group.broadcast(wire, self.group.rank)
        self.group.count_moved(entry.nbytes)
        return ReplayWork(entry.event)

    def _capture(self, layout: BucketLayout, wire: torch.Tensor,
                 payload: torch.Tensor) -> _Captured | None:
        """The frame's graph (with its broadcast unless that failed to capture before), or
        None where it cannot be one."""
        kernels = [(idx, k) for idx, k in layout.kernels if k.chunk_slot.numel()]
        if layout.misaligned or not kernels or any(k.vec not in k.graphs for _, k in kernels):
            return None  # bytes copied outside the kernels, or a kernel not warmed
        header = BufferKernel(wire, 8, [0], [HEADER_BYTES])
        header.warm()  # compiles it (the header copied onto itself)
        if self.checksums:
            checksum.stamp(wire, payload)  # compiles the hash kernel outside the capture
        event = torch.cuda.Event()
        for _, kernel in [*kernels, (None, header)]:
            kernel.uploaded.synchronize()
            kernel.uploaded = event  # an eager pack of this bucket guards the same tables
        for broadcasts in ((True, False) if self.failure is None else (False,)):
            try:
                graph = self._record(kernels, header, wire, payload, broadcasts)
            except RuntimeError as e:
                if broadcasts:
                    log.warning("%s: a frame's broadcast could not be captured in a CUDA graph, "
                                "it goes eagerly after each replay: %s", self.group.label, e)
                    self.failure = str(e)
                    continue
                log.warning("%s: a frame's pack could not be captured in a CUDA graph, sending "
                            "eagerly: %s", self.group.label, e)
                return None
            return _Captured(graph, kernels, header, event, wire.numel(), broadcasts)
        return None

    def _record(self, kernels: list, header: BufferKernel, wire: torch.Tensor,
                payload: torch.Tensor, broadcasts: bool) -> torch.cuda.CUDAGraph:
        graph = torch.cuda.CUDAGraph()
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        with torch.cuda.device(self.device_index), torch.cuda.stream(torch.cuda.Stream()):
            graph.capture_begin(pool=self._pool, capture_error_mode="thread_local")
            try:
                for _, kernel in kernels:
                    kernel.launch(kernel.vec)
                header.launch(header.vec)
                if self.checksums:
                    checksum.stamp(wire, payload)
                if broadcasts:
                    self.group.capture_broadcast(wire, self.group.rank)
            finally:
                graph.capture_end()
        return graph
