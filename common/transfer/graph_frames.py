"""Whole frames sent as CUDA graph replays: pack, header, checksum, broadcast.

On CUDA a bucket's sender time is host time: the pack kernels' graph replay and its event, the
header's device copy, ProcessGroupNCCL's broadcast call and its Work, tens of microseconds each
against tens of microseconds of device work for a 64 MiB bucket. Captured once per bucket, all of
it is one replay: the pack kernels read the sources' addresses from their device tables
(uploaded before the launch, only when the addresses change: a source whose tensors stay put
uploads them once, and its replays hold kernels alone), one more kernel copies the frame's
header from the refit's header table (the row's address is staged like a source's), the
checksum (when on) is stamped on the device, and the broadcast was captured on the capturing
stream (on the frame's subgroup for a need-set's whole frame). A few consecutive frames go as
one graph (a run), one launch for all. A replay is waited for through an event recorded behind
it, polled with the refit timeout like a collective's Work; a dead peer leaves the replayed
broadcast waiting on the GPU until the timeout aborts the communicator, as with an eager one. The
receivers' eager broadcasts pair with the replayed ones: every rank keeps the plan's order.

Only whole frames from their source go this way (not a direct bucket, a compact frame, a delta
or an ABORT), those its source fills too (an FP8 bucket, `PreparedBucket.stage_fill`: the
fill's launches first in the graph, then the pack of the other slots; in runs where the source
holds what the fill reads, `PreparedBucket.held`); a bucket whose capture failed, or whose
sources need another kernel variant than the captured one, goes eagerly; where the broadcast
cannot be captured, the graph holds the rest and the broadcast follows each replay eagerly.
`RefitConfig.graph_send` turns it on.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import numpy as np
import torch

from common.kernels.device_table import current_stream
from common.kernels.pack_kernel import BufferKernel
from common.packing import BucketLayout, kernel_tables
from common.source import PreparedBucket
from common.wire import checksum
from common.wire.bucket_header import HEADER_BYTES
from common.wire.transport import Transport

log = logging.getLogger(__name__)


class ReplayWork:
    """A replayed frame's completion, polled by `Transport.wait` as a collective's Work is;
    its event is set when the frame's graph is launched (a frame waits in `GraphFrames`'
    pending run until then)."""

    __slots__ = ("event",)

    def __init__(self, event: torch.cuda.Event | None = None) -> None:
        self.event = event

    def is_completed(self) -> bool:
        return self.event is not None and self.event.query()

    def wait(self) -> None:
        """Nothing to raise: a replay reports no error of its own (a stuck one times out)."""


class _Captured:
    """One frame's graph, the kernels whose staging tables it reads, and whether it holds the
    broadcast too (else the frame's broadcast is started eagerly after the replay)."""

    __slots__ = ("graph", "kernels", "header", "event", "nbytes", "broadcasts", "checked",
                 "tables", "frame", "header_at", "fill")

    def __init__(self, graph: torch.cuda.CUDAGraph, kernels: list, header: BufferKernel,
                 event: torch.cuda.Event, frame: tuple, broadcasts: bool,
                 fill: Callable[[], None] | None) -> None:
        self.graph, self.kernels, self.header, self.fill = graph, kernels, header, fill
        self.event, self.broadcasts = event, broadcasts
        # (wire, payload, the broadcast's subgroup or None: the whole group), bytes moved
        self.frame, self.nbytes = frame, frame[0].numel()
        # the last sources' addresses found fit for the graph (bytes) and each kernel's table
        self.checked: bytes | None = None
        self.tables: list[tuple[BufferKernel, np.ndarray, bytes]] = []
        self.header_at = 0  # the header row's address staged in `header`'s table


class _Run:
    """Consecutive frames captured as one graph (one launch for all of them)."""

    __slots__ = ("graph", "event")

    def __init__(self, graph: torch.cuda.CUDAGraph) -> None:
        self.graph, self.event = graph, torch.cuda.Event()


class GraphFrames:
    """A trainer's captured whole frames, one graph per frame it sources (made on the frame's
    first send). Where the transport's broadcast cannot be captured, the graphs hold the pack,
    header and checksum, and the broadcast goes eagerly after each replay.

    Frames whose sources the weight source keeps alive (a dict's tensors, not copies the
    sender frees after the send) wait in a pending run of up to `per_run` and go as one graph
    of the run (a graph launch costs host time like a frame's own work). A refit's runs grow
    from one frame: 1, 1, 2, 3, ... up to `per_run` (`run_limit`), so the device starts at once
    and is never left idle while the host takes a run much longer than the work queued before
    it (a run of n after one of m idles the device for the host's take of n - m frames, where
    the host takes a frame about as fast as the device sends it: FP8 fills). The sender
    calls `flush` before anything else reaches the group or the frames' buffers (an eager
    frame, the end of a refit): the run's frames then precede it on the stream and on the
    wire. `per_run` is at most the buffer count plus one: a trainer that sources none of the
    run takes at most that many buckets past the run's first before it waits for that frame,
    so the run's source can take (and gather with it) every bucket of the run before
    launching it."""

    def __init__(self, group: Transport, checksums: bool, per_run: int = 1) -> None:
        self.group, self.checksums, self.per_run = group, checksums, per_run
        self.device_index = group.device.index
        self._graphs: dict[tuple[int, int], _Captured | None] = {}
        self._runs: dict[tuple, _Run | None] = {}  # by the run's frame keys
        self._pending: list[tuple[tuple, _Captured, ReplayWork]] = []  # (key, entry, work)
        self._flushed = 0  # runs launched in this refit
        self._replans = 0  # the sharding's re-plans the graphs were captured after
        self.failure: str | None = None  # why capturing the broadcast failed (logged once)
        self.replays = 0  # frames sent by replay so far
        self.launches = 0  # graph launches (a run's frames in one)
        # One memory pool for every graph (the checksum's scratch): the replays run one after
        # another on one stream, so they can share it.
        self._pool: tuple | None = None

    @property
    def captured(self) -> int:
        """How many frames go by replay."""
        return sum(entry is not None for entry in self._graphs.values())

    def send(self, key: tuple[int, int], layout: BucketLayout, frame: tuple,
             ptrs: np.ndarray, header_address: int, held: bool = False) -> object | None:
        """Replay frame `key` (bucket, need-set: its `layout`, `frame` = its [header |
        payload] buffer, payload and broadcast subgroup) for sources at `ptrs` and the header
        row at `header_address`; with its run where the sources are `held` by the weight
        source beyond this call (a dict's tensors), else now (the caller frees its copies:
        the launch must come first). Returns what to wait for, or None: send it eagerly (the
        caller flushes first)."""
        if (entry := self._graphs.get(key, _Captured)) is _Captured:
            entry = self._graphs[key] = self._capture(layout, frame)
        if entry is None or header_address % 16:
            return None
        if (addresses := ptrs.tobytes()) != entry.checked:  # the tables are a function of ptrs
            tables = kernel_tables(entry.kernels, ptrs)
            if tables is None or any(k.vec_for(bits) != k.vec for k, _, bits in tables):
                return None  # sources aligned for another variant than the captured one
            entry.checked = addresses
            entry.tables = [(k, table.copy(), table.tobytes()) for k, table, _ in tables]
        for kernel, table, table_key in entry.tables:  # uploaded if changed
            kernel.ptrs.stage(table, table_key)
        return self._submit(key, entry, header_address, held)

    def send_filled(self, key: tuple[int, int], layout: BucketLayout, frame: tuple,
                    prepared: PreparedBucket, header_address: int,
                    mark: tuple[int, int]) -> tuple[object | None, Callable | None]:
        """Replay frame `key` whose source fills its slots (`PreparedBucket.stage_fill`,
        marking `mark` as `fill` does): the fill's launches, the pack kernels of the other
        slots (from `prepared.ptrs`), the header and the broadcast as one graph, launched now
        or, where what the fill reads is `held` (a dict's tensors), with its run.
        Returns what to wait for and the fill's check; (None, None): send it eagerly (after
        a flush: the fill may have been staged, nothing launched)."""
        tables = layout.other_tables(prepared)
        if tables is None or header_address % 16:
            return None, None
        tables = [(k, t, bits) for k, t, bits in tables if k.chunk_slot.numel()]
        if any(k.vec_for(bits) != k.vec or k.vec not in k.graphs for k, _, bits in tables):
            return None, None  # a kernel not run yet, or sources aligned for another variant
        staged = prepared.stage_fill(layout.slot_addresses(), mark)
        if staged.launch is None:
            return None, None  # not compiled yet: the eager fill compiles it
        full = (key, staged.key)
        if (entry := self._graphs.get(full, _Captured)) is _Captured:
            kernels = [(None, k) for k, _, _ in tables]
            entry = self._graphs[full] = self._capture_frame(kernels, frame, staged.launch)
        if entry is None:
            return None, None
        for kernel, table, _ in tables:
            kernel.ptrs.stage(table, table.tobytes())
        return self._submit(full, entry, header_address, prepared.held), staged.check

    def _submit(self, key: tuple, entry: _Captured, header_address: int,
                held: bool) -> object | None:
        """The frame's header row staged, then the frame launched or left pending in its run
        (`send`)."""
        if header_address != entry.header_at:  # the refit's header table stays put
            header = np.array([header_address], np.int64)
            entry.header.ptrs.stage(header, header.tobytes())
            entry.header_at = header_address
        if not entry.broadcasts:
            self.flush()
            self._launch(entry.graph, entry.event)
            self.replays += 1
            return self.group.broadcast(entry.frame[0], self.group.rank, entry.frame[2])
        self.group.count_moved(entry.nbytes)
        work = ReplayWork()
        self._pending.append((key, entry, work))
        if not held or len(self._pending) >= self.run_limit():
            self.flush()
        return work

    def run_limit(self) -> int:
        """How many frames the pending run takes before it launches: 1 for a refit's first
        two runs, then one more per run up to `per_run`."""
        return min(self.per_run, max(1, self._flushed))

    def flush(self) -> None:
        """Launch the pending run's frames (one graph; each frame's own where the run's
        cannot be captured)."""
        if not (pending := self._pending):
            return
        self._pending, self._flushed = [], self._flushed + 1
        self.replays += len(pending)
        run = None
        if len(pending) > 1:
            keys = tuple(key for key, _, _ in pending)
            if (run := self._runs.get(keys, _Run)) is _Run:
                run = self._runs[keys] = self._capture_run([e for _, e, _ in pending])
        if run is not None:
            self._launch(run.graph, run.event)
            for _, _, work in pending:
                work.event = run.event
            return
        for _, entry, work in pending:
            self._launch(entry.graph, entry.event)
            work.event = entry.event

    def start_refit(self, replans: int) -> None:
        """A refit starts: its runs grow from one frame again (`run_limit`); frames a failed
        refit left pending are dropped (never launched); after a re-plan (`replans`: how many
        so far) every graph is captured again, on the new subgroups."""
        self._pending, self._flushed = [], 0
        if replans != self._replans:
            self._graphs, self._runs, self._replans = {}, {}, replans

    def release(self) -> None:
        """Destroy every captured graph now (a sender set up again keeps none of them
        instantiated while its successor captures its own)."""
        for entry in [*self._graphs.values(), *self._runs.values()]:
            if entry is not None:
                entry.graph.reset()
        self._graphs, self._runs, self._pending = {}, {}, []

    def _launch(self, graph: torch.cuda.CUDAGraph, event: torch.cuda.Event) -> None:
        """Replay `graph` and record `event` behind it (its frames' completion)."""
        if torch._C._cuda_getDevice() == self.device_index:
            graph.replay()
        else:
            with torch.cuda.device(self.device_index):
                graph.replay()
        event.record(current_stream(self.device_index))
        self.launches += 1

    def _capture(self, layout: BucketLayout, frame: tuple) -> _Captured | None:
        """The frame's graph (with its broadcast unless that failed to capture before), or
        None where it cannot be one."""
        kernels = [(idx, k) for idx, k in layout.kernels if k.chunk_slot.numel()]
        if layout.misaligned or not kernels or any(k.vec not in k.graphs for _, k in kernels):
            return None  # bytes copied outside the kernels, or a kernel not warmed
        return self._capture_frame(kernels, frame, None)

    def _capture_frame(self, kernels: list, frame: tuple,
                       fill: Callable[[], None] | None) -> _Captured | None:
        """A frame's graph: `fill` (a source's own writes into it), `kernels`, its header,
        checksum and broadcast (unless that failed to capture before), or None."""
        wire, payload, _ = frame
        header = BufferKernel(wire, 8, [0], [HEADER_BYTES])
        header.warm()  # compiles it (the header copied onto itself)
        if self.checksums:
            checksum.stamp(wire, payload)  # compiles the hash kernel outside the capture
        for broadcasts in ((True, False) if self.failure is None else (False,)):
            try:
                graph = self._record([(fill, kernels, header, frame)], broadcasts)
            except RuntimeError as e:
                if broadcasts:
                    log.warning("%s: a frame's broadcast could not be captured in a CUDA graph, "
                                "it goes eagerly after each replay: %s", self.group.label, e)
                    self.failure = str(e)
                    continue
                log.warning("%s: a frame's pack could not be captured in a CUDA graph, sending "
                            "eagerly: %s", self.group.label, e)
                return None
            return _Captured(graph, kernels, header, torch.cuda.Event(), frame, broadcasts,
                             fill)
        return None

    def _capture_run(self, entries: list[_Captured]) -> _Run | None:
        """One graph of `entries`' frames in order, or None (each replays its own)."""
        try:
            graph = self._record([(e.fill, e.kernels, e.header, e.frame) for e in entries],
                                 broadcasts=True)
        except Exception as e:  # noqa: BLE001 - the frames still go, each by its own graph
            log.warning("%s: %d frames could not be captured as one CUDA graph, each goes by "
                        "its own: %s", self.group.label, len(entries), e)
            return None
        return _Run(graph)

    def _record(self, frames: list[tuple], broadcasts: bool) -> torch.cuda.CUDAGraph:
        """A graph of `frames` (fill or None, kernels, header kernel, (wire, payload,
        subgroup)) in order."""
        graph = torch.cuda.CUDAGraph()
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        with torch.cuda.device(self.device_index), torch.cuda.stream(torch.cuda.Stream()):
            graph.capture_begin(pool=self._pool, capture_error_mode="thread_local")
            try:
                for fill, kernels, header, (wire, payload, sub) in frames:
                    if fill is not None:
                        fill()
                    for _, kernel in kernels:
                        kernel.launch(kernel.vec)
                    header.launch(header.vec)
                    if self.checksums:
                        checksum.stamp(wire, payload)
                    if broadcasts:
                        self.group.capture_broadcast(wire, self.group.rank, sub)
            finally:
                graph.capture_end()
        return graph
