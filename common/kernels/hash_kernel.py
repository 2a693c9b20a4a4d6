"""A position-sensitive 64-bit hash of a CUDA buffer's bytes, computed on the device (Triton).

Each 4-byte word w at index i adds (w + 1) * M(i) modulo 2**64, with M(i) an odd multiplier
mixed from i: a changed bit changes the sum (M is odd), two different words swapped change it
unless their multipliers happen to agree. Integer sums wrap, so the order of the partial sums
does not matter and the sender and every receiver get the same value. The tail (fewer than 4
bytes) is hashed the same way per byte, after the words. The result stays on the device
(`device_hash`), so the sender can stamp it into a header without waiting for the GPU.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - machines without Triton send no CUDA checksum
    triton = None

BLOCK = 8192  # words per program
GOLDEN = -7046029254386353131  # 0x9E3779B97F4A7C15 as a signed 64-bit integer

if triton is not None:

    @triton.jit
    def _hash_words(words, n, start, partial, GOLDEN: tl.constexpr, BLOCK: tl.constexpr):
        pid = tl.program_id(0)
        offs = pid * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        w = tl.load(words + offs, mask=mask, other=0).to(tl.int64)
        index = (offs + start).to(tl.int64)
        mult = ((index ^ (index >> 29)) * GOLDEN) | 1
        tl.store(partial + pid, tl.sum(tl.where(mask, (w + 1) * mult, 0), axis=0))


def available(device: torch.device) -> bool:
    return triton is not None and device.type == "cuda"


def _tail_hash(tail: torch.Tensor, start: int) -> torch.Tensor:
    """The same sum over the last bytes (torch ops: at most 3 of them)."""
    index = torch.arange(start, start + tail.numel(), dtype=torch.int64, device=tail.device)
    mult = ((index ^ (index >> 29)) * GOLDEN) | 1
    return ((tail.to(torch.int64) + 1) * mult).sum()


def device_hash(payload: torch.Tensor) -> torch.Tensor:
    """The hash of a contiguous uint8 CUDA tensor, as a 0-d int64 tensor on its device."""
    if payload.data_ptr() % 4:  # words need 4-byte alignment: hash an aligned copy
        payload = payload.clone()
    n = payload.numel()
    whole = n // 4
    total = torch.zeros((), dtype=torch.int64, device=payload.device)
    if whole:
        words = payload[: whole * 4].view(torch.int32)
        grid = triton.cdiv(whole, BLOCK)
        partial = torch.empty(grid, dtype=torch.int64, device=payload.device)
        with torch.cuda.device(payload.device):
            _hash_words[(grid,)](words, whole, 0, partial, GOLDEN=GOLDEN, BLOCK=BLOCK)
        total += partial.sum()
    if whole * 4 < n:
        total += _tail_hash(payload[whole * 4:], whole)
    return total
