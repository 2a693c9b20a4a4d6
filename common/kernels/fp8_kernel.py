"""Block-FP8 quantization in one CUDA pass (Triton): one program per (rows x cols) block reads
it once, takes its amax, writes its e4m3 values and its float32 scale_inv; one launch covers
every tensor of one shape (their addresses in a table), so an MoE layer's experts cost one
launch, not one each.

It reproduces what vLLM's `per_block_cast_to_fp8` computes with torch ops on CUDA, operation
for operation: the amax clamped at 1e-4; the scale as amax times the float32 reciprocal of the
e4m3 maximum (torch divides a CUDA tensor by a host scalar that way); optionally rounded up to
a power of two (log2 and exp2 from libdevice, as CUDA's log2f / powf); the values multiplied by
the scale's correctly rounded reciprocal and rounded to nearest into e4m3 (saturating).
`common.quant.fp8_blocks.quantize` calls it for CUDA tensors and checks the scales after.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import numpy as np
import torch

try:
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice
except ImportError:  # pragma: no cover - machines without Triton use the torch ops
    triton = None

FP8_MAX = 448.0
_INV_FP8_MAX = float(np.float32(1.0) / np.float32(FP8_MAX))  # rounded to float32, as CUDA's


def available(x: torch.Tensor, block: tuple[int, int]) -> bool:
    """Whether the kernel serves `x` (a CUDA tensor) at `block` (powers of two, for tiles)."""
    return (triton is not None and x.is_cuda and x.numel() > 0
            and all(b & (b - 1) == 0 for b in block))


if triton is not None:
    _IN = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}

    @triton.jit
    def _quantize_blocks(x_addrs, q, s, m, n, stride_m, stride_n, blocks_m, blocks_n, inv_max,
                         IN: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                         UE8M0: tl.constexpr, ALIGN: tl.constexpr):
        # program (t, i, j): block (i, j) of tensor t, read at its address in `x_addrs` (a
        # multiple of ALIGN bytes: an address loaded from memory otherwise leaves Triton
        # assuming one element's alignment, and no wide loads)
        t, pid_m, pid_n = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        x = tl.multiple_of(tl.load(x_addrs + t), ALIGN).to(tl.pointer_type(IN))
        rows = pid_m * BM + tl.arange(0, BM)[:, None]
        cols = pid_n * BN + tl.arange(0, BN)[None, :]
        mask = (rows < m) & (cols < n)
        v = tl.load(x + rows * stride_m + cols * stride_n, mask=mask, other=0.0).to(tl.float32)
        amax = tl.maximum(tl.max(tl.max(tl.abs(v), axis=1), axis=0), 1e-4)
        sf = amax * inv_max
        if UE8M0:
            sf = libdevice.exp2(tl.ceil(libdevice.log2(sf)))
        nans = tl.sum(tl.sum((v != v).to(tl.int32), axis=1), axis=0)
        sf = tl.where(nans > 0, float("nan"), sf)  # the caller refuses non-finite scales
        inv = tl.math.div_rn(1.0, sf)
        t64 = t.to(tl.int64)
        tl.store(q + t64 * m * n + rows * n + cols, (v * inv).to(tl.float8e4nv), mask=mask)
        tl.store(s + (t64 * blocks_m + pid_m) * blocks_n + pid_n, sf)


def address_table(ptrs: Sequence[int] | np.ndarray,
                  device: torch.device) -> tuple[torch.Tensor, int]:
    """Tensor addresses on `device`, for `launch`, and the bytes all of them are a multiple
    of (a power of two, 16 at most: the widest load). Pinned and non-blocking on CUDA: a
    pageable upload would wait for the stream to drain."""
    host = np.asarray(ptrs, dtype=np.int64)
    bits = int(np.bitwise_or.reduce(host)) | 16 if len(host) else 16
    table = torch.from_numpy(host)
    if device.type == "cuda":
        table = table.pin_memory()
    return table.to(device, non_blocking=True), bits & -bits


def launch(addrs: torch.Tensor, align: int, like: torch.Tensor, q: torch.Tensor,
           s: torch.Tensor, block: tuple[int, int], ue8m0: bool) -> None:
    """Quantize the tensors at `addrs` (each a multiple of `align` bytes, of `like`'s shape,
    strides and dtype) into `q` (e4m3, [len(addrs), m, n], contiguous) and `s` (float32
    scale_inv, [len(addrs), blocks_m, blocks_n], contiguous: may be a view into a larger
    buffer)."""
    (m, n), (bm, bn) = like.shape, block
    blocks = (triton.cdiv(m, bm), triton.cdiv(n, bn))
    grid = (len(addrs), *blocks)
    args = (addrs, q, s, m, n, like.stride(0), like.stride(1), blocks[0], blocks[1],
            _INV_FP8_MAX)
    consts = dict(IN=_IN[like.dtype], BM=bm, BN=bn, UE8M0=ue8m0, ALIGN=align, num_warps=8)
    # CPU tensors: Triton's interpreter (TRITON_INTERPRET=1), for tests without a GPU
    with torch.cuda.device(like.device) if like.is_cuda else contextlib.nullcontext():
        _quantize_blocks[grid](*args, **consts)


def quantize(x: torch.Tensor, block: tuple[int, int],
             ue8m0: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 values of x's shape, float32 scale_inv per block) of the 2-D CUDA tensor `x`
    (a batch of one shape goes through `launch` with its own address table)."""
    (m, n), (bm, bn) = x.shape, block
    q = torch.empty((1, m, n), dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty((1, triton.cdiv(m, bm), triton.cdiv(n, bn)), dtype=torch.float32,
                    device=x.device)
    launch(*address_table([x.data_ptr()], x.device), x, q, s, block, ue8m0)
    return q[0], s[0]
