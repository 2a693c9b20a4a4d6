"""One-launch CUDA copies between one bucket buffer and many tensors (Triton).

A foreach copy of thousands of small tensors launches many kernels that each carry few
tensors; one kernel over a pointer table copies every tensor of a bucket in one launch. The
buffer side (offsets, sizes) is fixed by the plan, so the chunk table is built once; the other
side's pointers are uploaded only when they change (a source whose tensors stay put uploads
them once), and after the first call of a bucket the launch replays as a CUDA graph. The same
kernel packs the sender's tensors into the buffer
and scatters a received buffer into the engine's params (`scatter=True`). Where every address and
size is 16-byte aligned the kernel is told so (`VEC`) and moves 16-byte words: addresses loaded
from memory otherwise leave Triton assuming one-element alignment.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from common.kernels.device_table import DeviceTable, replay_or_launch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - machines without Triton use the foreach copy
    triton = None

BLOCK = 4096  # copy units per program
NUM_WARPS = 8  # per program
_UNIT_DTYPES = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}

if triton is not None:

    @triton.jit
    def _copy_chunks(ptrs, buf, buf_offs, sizes, chunk_slot, chunk_start, BLOCK: tl.constexpr,
                     VEC: tl.constexpr, ALIGN: tl.constexpr, SCATTER: tl.constexpr):
        pid = tl.program_id(0)
        slot = tl.load(chunk_slot + pid)
        start = tl.multiple_of(tl.load(chunk_start + pid), BLOCK)
        n = tl.multiple_of(tl.load(sizes + slot), VEC)  # in elements, like the offsets
        address = tl.multiple_of(tl.load(ptrs + slot), ALIGN)  # in bytes
        other = address.to(buf.dtype)  # int64 address -> typed pointer
        offs = start + tl.arange(0, BLOCK)
        mask = offs < n
        here = buf + tl.multiple_of(tl.load(buf_offs + slot), VEC) + offs
        if SCATTER:
            tl.store(other + offs, tl.load(here, mask=mask), mask=mask)
        else:
            tl.store(here, tl.load(other + offs, mask=mask), mask=mask)


def block_for(units: np.ndarray) -> int:
    """A program size for slots of `units` copy units each: the power of two at or above
    their median, between 256 and `BLOCK`."""
    median = float(np.median(units)) if len(units) else BLOCK
    return int(min(BLOCK, max(256, 1 << max(0, int(np.ceil(np.log2(max(median, 1))))))))


def kernel_available(device: torch.device) -> bool:
    return triton is not None and device.type == "cuda"


class BufferKernel:
    """Chunk table for slots of `buffer` copied in `unit`-byte words; `run(ptrs)` copies each
    slot from (`scatter=False`: the pack) or to (`scatter=True`) the address in `ptrs`."""

    def __init__(self, buffer: torch.Tensor, unit: int, offsets: Sequence[int],
                 nbytes: Sequence[int], scatter: bool = False, block: int = BLOCK) -> None:
        """`block`: copy units per program (a power of two); slots much smaller than it
        leave most of each program idle (`block_for`)."""
        self.unit = u = unit
        self.block = block
        self.scatter = scatter
        dev = buffer.device
        self.buf = buffer[: buffer.numel() // u * u].view(_UNIT_DTYPES[u])
        self.device_index = dev.index
        base = buffer.data_ptr()
        # 16-byte words where every slot and size allows (the other side is checked per run)
        self.vec = 16 // u if all((base + o) % 16 == 0 and n % 16 == 0
                                  for o, n in zip(offsets, nbytes, strict=True)) else 1
        sizes = [n // u for n in nbytes]
        slots = [i for i, n in enumerate(sizes) for _ in range(0, n, block)]
        starts = [s for n in sizes for s in range(0, n, block)]
        self.buf_offs = torch.tensor([o // u for o in offsets], dtype=torch.int64, device=dev)
        self.sizes = torch.tensor(sizes, dtype=torch.int64, device=dev)
        self.chunk_slot = torch.tensor(slots, dtype=torch.int32, device=dev)
        self.chunk_start = torch.tensor(starts, dtype=torch.int64, device=dev)
        self.ptrs = DeviceTable(len(sizes), dev)  # the other side's addresses, by slot
        self.graphs: dict[int, torch.cuda.CUDAGraph | None] = {}  # per VEC, captured on first use
        self.home = np.array([base + o for o in offsets], dtype=np.int64)  # the slots' addresses

    def warm(self) -> None:
        """Compile the kernel and capture its graph now, copying every slot onto itself (each
        program reads its chunk, then writes it back), so the first refit runs at speed."""
        if len(self.home):
            self.run(self.home, int(np.bitwise_or.reduce(self.home)))

    def release(self) -> None:
        """Destroy the captured graphs (the next run captures again)."""
        for graph in self.graphs.values():
            if graph is not None:
                graph.reset()
        self.graphs.clear()

    def run(self, ptrs: np.ndarray, address_bits: int) -> None:
        """Copy between the slots and the addresses `ptrs` (contiguous, unit-aligned, this
        device); `address_bits`: the bitwise or of them (its low bits: their alignment)."""
        if not self.chunk_slot.numel():
            return
        vec = self.vec_for(address_bits)
        self.ptrs.stage(ptrs, ptrs.tobytes())
        def launch() -> None:
            self.launch(vec)

        if torch._C._cuda_getDevice() == self.device_index:
            replay_or_launch(self.graphs, vec, launch, "pack kernel")
        else:  # Triton launches on the current device
            with torch.cuda.device(self.device_index):
                replay_or_launch(self.graphs, vec, launch, "pack kernel")

    def vec_for(self, address_bits: int) -> int:
        """The 16-byte word count the kernel may use for addresses whose bitwise or is
        `address_bits`."""
        return self.vec if address_bits % 16 == 0 else 1

    def launch(self, vec: int) -> None:
        """Copy between the slots and the addresses of the device table (eagerly, or into a
        graph being captured: it reads the table when it runs)."""
        _copy_chunks[(self.chunk_slot.numel(),)](
            self.ptrs.words, self.buf, self.buf_offs, self.sizes, self.chunk_slot,
            self.chunk_start,
            BLOCK=self.block, VEC=vec, ALIGN=vec * self.unit, SCATTER=self.scatter,
            num_warps=NUM_WARPS)
