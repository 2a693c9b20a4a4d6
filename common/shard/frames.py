"""Compact frames on the wire: their buffers and the sender's copy of a set's bytes into them.

A compact need-set's frames live in N buffers of [header | the set's largest payload] on each
rank that takes part (every trainer, the set's workers), in rotation like the bucket buffers.
`GatherCopy` fills one frame's payload from the bucket's tensors (`common.shard.plan.Gather`):
one native memcpy loop on CPU, one pointer-table kernel per copy unit on CUDA (`BufferKernel`),
no per-piece Python on either; only where neither exists, a loop of small copies.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import numpy as np
import torch

from common.host_memory import host_bytes
from common.kernels import native
from common.kernels.pack_kernel import BufferKernel, block_for, kernel_available
from common.packing import byte_view
from common.shard.plan import Gather


class CompactBuffers:
    """One compact need-set's N frame buffers on this rank."""

    def __init__(self, device: torch.device, payload_start: int, payload_bytes: int,
                 num_buffers: int, pinned: bool = False) -> None:
        """`pinned`: page-locked host memory where it can be (`Endpoint.make_buffers`)."""
        self.payload_start = payload_start
        # zeros, not empty: the first refit of a re-plan does not page-fault them in (CPU)
        self.buffers = [host_bytes(payload_start + payload_bytes, device, pinned, zeros=True)
                        for _ in range(num_buffers)]
        self.copies: dict[tuple[int, int], GatherCopy] = {}  # (slot, bucket) -> its copy

    def frame(self, slot: int, gather: Gather) -> torch.Tensor:
        """The frame ([header | payload]) of a bucket whose compact bytes are `gather`."""
        return self.buffers[slot % len(self.buffers)][: self.payload_start + gather.nbytes]

    def payload(self, slot: int, gather: Gather) -> torch.Tensor:
        return self.frame(slot, gather)[self.payload_start:]

    def fill(self, slot: int, index: int, gather: Gather, tensors: Sequence[torch.Tensor],
             ptrs: np.ndarray | None) -> None:
        """Copy bucket `index`'s compact bytes from its `tensors` into its frame."""
        key = (slot % len(self.buffers), index)
        if key not in self.copies:
            self.copies[key] = GatherCopy(gather, self.payload(slot, gather))
        self.copies[key].run(tensors, ptrs)


class GatherCopy:
    """One bucket's compact bytes into one payload buffer (see the module docstring)."""

    def __init__(self, gather: Gather, payload: torch.Tensor) -> None:
        self.gather, self.payload = gather, payload
        self.dst = payload.data_ptr() + gather.dst
        self.kernels: list[tuple[BufferKernel, np.ndarray]] = []
        if kernel_available(payload.device) and len(gather.n):
            units = np.gcd(np.gcd(gather.off, gather.dst), np.gcd(gather.n, 8))
            for unit in np.unique(units)[::-1]:
                idx = np.flatnonzero(units == unit)
                self.kernels.append((BufferKernel(payload, int(unit), gather.dst[idx].tolist(),
                                                  gather.n[idx].tolist(),
                                                  block=block_for(gather.n[idx] // unit)), idx))

    def run(self, tensors: Sequence[torch.Tensor], ptrs: np.ndarray | None) -> None:
        """`ptrs`: the tensors' addresses where the caller knows them all contiguous on this
        device; otherwise they are made so here."""
        g = self.gather
        if not len(g.n):
            return
        keep: list[torch.Tensor] = []  # contiguous copies, alive until the copy is issued
        if ptrs is None:
            keep = [byte_view(t.to(self.payload.device).contiguous()) for t in tensors]
            ptrs = np.fromiter(map(torch.Tensor.data_ptr, keep), np.int64, len(keep))
        src = ptrs[g.pos] + g.off
        if self.payload.device.type == "cpu":
            if module := native.load():
                module.copy_bytes(torch.from_numpy(src), torch.from_numpy(self.dst),
                                  torch.from_numpy(g.n))
            else:
                for s, d, n in zip(src.tolist(), self.dst.tolist(), g.n.tolist(), strict=True):
                    ctypes.memmove(d, s, n)
            return
        if not self.kernels:  # a CUDA device without Triton
            self._loop(tensors, keep, np.arange(len(g.n)))
        for kernel, idx in self.kernels:
            table = src[idx]
            bits = int(np.bitwise_or.reduce(table))
            if bits % kernel.unit:  # a source not aligned to the pieces' copy unit
                self._loop(tensors, keep, idx)
            else:
                kernel.run(table, bits)

    def _loop(self, tensors: Sequence[torch.Tensor], keep: list[torch.Tensor],
              idx: np.ndarray) -> None:
        """The pieces `idx` one copy each (no kernel for them)."""
        views = keep or [byte_view(t.to(self.payload.device).contiguous()) for t in tensors]
        g = self.gather
        for i in idx.tolist():
            p, o, d, n = int(g.pos[i]), int(g.off[i]), int(g.dst[i]), int(g.n[i])
            self.payload[d : d + n].copy_(views[p][o : o + n], non_blocking=True)
