"""One-launch CUDA pack of many small tensors into a bucket buffer (Triton).

A foreach copy of 20,000 x 0.39 MB tensors reaches ~1.25 TB/s on an H200 (its launches carry
few tensors each); one kernel over a pointer table copies every tensor of a bucket in one launch.
The bucket's destinations and sizes are fixed by the plan, so the chunk table is built once;
each pack only uploads the source pointers. Used when Triton is importable and every source is
aligned to the copy unit; otherwise `BucketLayout` falls back to the foreach copy.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - CPU machines without Triton
    triton = None

BLOCK = 4096  # copy units per program
_UNITS = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}

if triton is not None:

    @triton.jit
    def _copy_chunks(src_ptrs, dst, dst_offs, sizes, chunk_slot, chunk_start,
                     BLOCK: tl.constexpr):
        pid = tl.program_id(0)
        slot = tl.load(chunk_slot + pid)
        start = tl.load(chunk_start + pid)
        n = tl.load(sizes + slot)
        src = tl.load(src_ptrs + slot).to(dst.dtype)
        offs = start + tl.arange(0, BLOCK)
        mask = offs < n
        vals = tl.load(src + offs, mask=mask)
        tl.store(dst + tl.load(dst_offs + slot) + offs, vals, mask=mask)


class KernelPack:
    """Chunk table of one bucket's contiguous slots; `pack(srcs)` copies them in one launch."""

    def __init__(self, buffer: torch.Tensor, offsets: Sequence[int], nbytes: Sequence[int]):
        self.unit = math.gcd(8, buffer.data_ptr(), *offsets, *nbytes)
        dev = buffer.device
        u = self.unit
        self.dst = buffer[: buffer.numel() // u * u].view(_UNITS[u])
        sizes = [n // u for n in nbytes]
        slots, starts = [], []
        for i, n in enumerate(sizes):
            for start in range(0, n, BLOCK):
                slots.append(i)
                starts.append(start)
        self.dst_offs = torch.tensor([o // u for o in offsets], dtype=torch.int64, device=dev)
        self.sizes = torch.tensor(sizes, dtype=torch.int64, device=dev)
        self.chunk_slot = torch.tensor(slots, dtype=torch.int32, device=dev)
        self.chunk_start = torch.tensor(starts, dtype=torch.int64, device=dev)

    def aligned(self, srcs: Sequence[torch.Tensor]) -> bool:
        """Whether every source address is a multiple of the copy unit."""
        return all(t.data_ptr() % self.unit == 0 for t in srcs)

    def pack(self, srcs: Sequence[torch.Tensor]) -> None:
        """Copy `srcs` (contiguous, aligned, on the buffer's device) in one launch."""
        if not self.chunk_slot.numel():
            return
        ptrs = [t.data_ptr() for t in srcs]
        src_ptrs = torch.tensor(ptrs, dtype=torch.int64, device=self.dst.device)
        _copy_chunks[(self.chunk_slot.numel(),)](
            src_ptrs, self.dst, self.dst_offs, self.sizes, self.chunk_slot, self.chunk_start,
            BLOCK=BLOCK)


def kernel_available(device: torch.device) -> bool:
    return triton is not None and device.type == "cuda"
