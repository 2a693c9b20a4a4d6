"""One-launch CUDA pack of many small tensors into a bucket buffer (Triton).

A foreach copy of 20,000 x 0.39 MB tensors reaches ~1.25 TB/s on an H200 (each of its launches
carries few tensors); one kernel over a pointer table copies every tensor of a bucket in one
launch. The bucket's destinations and sizes are fixed by the plan, so the chunk table is built
once; each pack only uploads the source pointers.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - machines without Triton use the foreach copy
    triton = None

BLOCK = 4096  # copy units per program
_UNIT_DTYPES = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}

if triton is not None:

    @triton.jit
    def _copy_chunks(src_ptrs, dst, dst_offs, sizes, chunk_slot, chunk_start,
                     BLOCK: tl.constexpr):
        pid = tl.program_id(0)
        slot = tl.load(chunk_slot + pid)
        start = tl.load(chunk_start + pid)
        n = tl.load(sizes + slot)
        src = tl.load(src_ptrs + slot).to(dst.dtype)  # int64 address -> typed pointer
        offs = start + tl.arange(0, BLOCK)
        mask = offs < n
        vals = tl.load(src + offs, mask=mask)
        tl.store(dst + tl.load(dst_offs + slot) + offs, vals, mask=mask)


def kernel_available(device: torch.device) -> bool:
    return triton is not None and device.type == "cuda"


class KernelPack:
    """Chunk table for slots copied in `unit`-byte words; `pack(ptrs)` copies in one launch."""

    def __init__(self, buffer: torch.Tensor, unit: int, offsets: Sequence[int],
                 nbytes: Sequence[int]) -> None:
        self.unit = u = unit
        dev = buffer.device
        self.dst = buffer[: buffer.numel() // u * u].view(_UNIT_DTYPES[u])
        sizes = [n // u for n in nbytes]
        slots = [i for i, n in enumerate(sizes) for _ in range(0, n, BLOCK)]
        starts = [s for n in sizes for s in range(0, n, BLOCK)]
        self.dst_offs = torch.tensor([o // u for o in offsets], dtype=torch.int64, device=dev)
        self.sizes = torch.tensor(sizes, dtype=torch.int64, device=dev)
        self.chunk_slot = torch.tensor(slots, dtype=torch.int32, device=dev)
        self.chunk_start = torch.tensor(starts, dtype=torch.int64, device=dev)
        # Source pointers go up through a pinned staging table, non-blocking: a pageable upload
        # would wait for the stream (the previous bucket's kernel), so the host could not
        # prepare the next bucket meanwhile. `uploaded` guards the staging table's reuse.
        self.host_ptrs = torch.empty(len(sizes), dtype=torch.int64, pin_memory=True)
        self.src_ptrs = torch.empty(len(sizes), dtype=torch.int64, device=dev)
        self.uploaded = torch.cuda.Event()

    def pack(self, ptrs: np.ndarray) -> None:
        """Copy from the source addresses `ptrs` (contiguous, unit-aligned, this device)."""
        if not self.chunk_slot.numel():
            return
        self.uploaded.synchronize()  # the last upload from the staging table has been read
        self.host_ptrs.numpy()[:] = ptrs
        with torch.cuda.device(self.dst.device):  # Triton launches on the current device
            self.src_ptrs.copy_(self.host_ptrs, non_blocking=True)
            self.uploaded.record()
            _copy_chunks[(self.chunk_slot.numel(),)](
                self.src_ptrs, self.dst, self.dst_offs, self.sizes, self.chunk_slot,
                self.chunk_start, BLOCK=BLOCK)
