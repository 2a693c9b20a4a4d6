"""Block-FP8 quantization in one CUDA pass (Triton): one program per (rows x cols) block reads
it once, takes its amax, writes its e4m3 values and its float32 scale_inv; one launch covers
every tensor of one shape (their input and output addresses in a table, so the outputs may be
a frame's slots), so an MoE layer's experts cost one launch, not one each. A block that is not
finite also marks two int64 words (a flag, a frame header's status) with no host sync.

It reproduces what vLLM's `per_block_cast_to_fp8` computes with torch ops on CUDA, operation
for operation: the amax clamped at 1e-4 (a block holding NaN gets an inf scale, not NaN);
the scale as amax times the float32 reciprocal of the e4m3 maximum (torch divides a CUDA
tensor by a host scalar that way); optionally rounded up to a power of two (log2 and exp2 from
libdevice, as CUDA's log2f / powf); the values multiplied by the scale's correctly rounded
reciprocal and rounded to nearest into e4m3 (saturating).
`common.quant.fp8_blocks.quantize` calls it for CUDA tensors and checks the scales after.
"""

from __future__ import annotations

import contextlib
import ctypes
from typing import NamedTuple

import numpy as np
import torch

from common.kernels.device_table import DeviceTable, replay_or_launch

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
    def _quantize_blocks(addrs, count, marks, q_base, s_base, m, n, stride_m, stride_n,
                         blocks_n, inv_max, IN: tl.constexpr, BM: tl.constexpr,
                         BN: tl.constexpr, UE8M0: tl.constexpr, ALIGN: tl.constexpr,
                         Q_ALIGN: tl.constexpr):
        # program (t, i, j): block (i, j) of tensor t; `addrs` holds every tensor's input
        # address (a multiple of ALIGN bytes), then its e4m3 values' offset from `q_base` (a
        # multiple of Q_ALIGN), then its scales' from `s_base`, in elements. The outputs go
        # through pointer arguments plus offsets: a pointer loaded from memory leaves Triton
        # no alignment to prove, and byte-wide fp8 stores run several times slower.
        t, pid_m, pid_n = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        x = tl.multiple_of(tl.load(addrs + t), ALIGN).to(tl.pointer_type(IN))
        q = q_base + tl.multiple_of(tl.load(addrs + count + t), Q_ALIGN)
        s = s_base + tl.load(addrs + 2 * count + t)
        rows = pid_m * BM + tl.arange(0, BM)[:, None]
        cols = pid_n * BN + tl.arange(0, BN)[None, :]
        mask = (rows < m) & (cols < n)
        v = tl.load(x + rows * stride_m + cols * stride_n, mask=mask, other=0.0).to(tl.float32)
        # one max reduction gives the amax, inf where the block holds NaN or inf: a NaN counts
        # as inf (a plain max drops NaN; Triton's interpreter runs only built-in ones fast)
        amax = tl.max(tl.max(tl.where(v == v, tl.abs(v), float("inf")), axis=1), axis=0)
        sf = tl.maximum(amax, 1e-4) * inv_max
        if UE8M0:
            sf = libdevice.exp2(tl.ceil(libdevice.log2(sf)))
        inv = tl.math.div_rn(1.0, sf)
        tl.store(q + rows * n + cols, (v * inv).to(tl.float8e4nv), mask=mask)
        tl.store(s + pid_m * blocks_n + pid_n, sf)
        # a non-finite block marks two int64 words (`marks`: their addresses, then the first's
        # base value, to which the tensor's index is added, then the second's value)
        bad = ~(tl.abs(sf) < float("inf"))
        flag = tl.load(marks).to(tl.pointer_type(tl.int64))
        status = tl.load(marks + 1).to(tl.pointer_type(tl.int64))
        tl.store(flag, tl.load(marks + 2) + t, mask=bad)
        tl.store(status, tl.load(marks + 3), mask=bad)


def alignment(ptrs: np.ndarray) -> int:
    """The bytes every address in `ptrs` is a multiple of (a power of two, 16 at most: the
    widest access)."""
    bits = (int(np.bitwise_or.reduce(ptrs)) if len(ptrs) else 0) | 16
    return bits & -bits


def upload(table: np.ndarray, device: torch.device) -> torch.Tensor:
    """An int64 table on `device`, pinned and non-blocking on CUDA: a pageable upload would
    wait for the stream to drain."""
    host = torch.from_numpy(np.ascontiguousarray(table, dtype=np.int64))
    if device.type == "cuda":
        host = host.pin_memory()
    return host.to(device, non_blocking=True)


class Base:
    """A device address as a kernel's pointer argument of `dtype` (Triton takes any object
    with `data_ptr()` and `dtype`)."""

    def __init__(self, address: int, dtype: torch.dtype) -> None:
        self.address, self.dtype = address, dtype

    def data_ptr(self) -> int:
        return self.address


def _pointer(address: int, dtype: torch.dtype, device: torch.device) -> Base | torch.Tensor:
    if device.type == "cuda":
        return Base(address, dtype)
    # Triton's interpreter (CPU tensors) takes tensors only: 16 bytes at the address
    raw = (ctypes.c_char * 16).from_address(address)
    return torch.frombuffer(raw, dtype=torch.uint8).view(dtype)


def offsets(at: np.ndarray, itemsize: int) -> tuple[int, np.ndarray]:
    """Addresses `at` as a 16-byte aligned base address and offsets from it in elements of
    `itemsize` bytes (the addresses must be multiples of it)."""
    base = int(at.min()) & ~15 if len(at) else 0
    return base, (at - base) // itemsize


class Like(NamedTuple):
    """What one launch's tensors share (shape, strides, dtype, device), without holding one."""

    shape: tuple[int, ...]
    strides: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device


def like(x: torch.Tensor) -> Like:
    return Like(tuple(x.shape), x.stride(), x.dtype, x.device)


def launch(addrs: torch.Tensor, count: int, aligns: tuple[int, int], like: Like,
           block: tuple[int, int], ue8m0: bool, marks: torch.Tensor,
           bases: tuple[int, int]) -> None:
    """Quantize `count` tensors (each like `like`; their input addresses a multiple of
    `aligns[0]` bytes) into contiguous e4m3 values and float32 scale_inv blocks [blocks_m,
    blocks_n]. `addrs`: on the device, the inputs' addresses, then the values' offsets from
    `bases[0]` (multiples of `aligns[1]`), then the scales' from `bases[1]` in float32
    elements (`offsets`; a slice of a larger upload). `marks`: on the device, two int64 words'
    addresses, a base and a value: a tensor with a non-finite block writes base + its index
    into the first, value into the second (and its scales hold NaN or inf)."""
    (m, n), (bm, bn) = like.shape, block
    blocks = (triton.cdiv(m, bm), triton.cdiv(n, bn))
    args = (addrs, count, marks, _pointer(bases[0], torch.float8_e4m3fn, like.device),
            _pointer(bases[1], torch.float32, like.device), m, n, *like.strides,
            blocks[1], _INV_FP8_MAX)
    consts = dict(IN=_IN[like.dtype], BM=bm, BN=bn, UE8M0=ue8m0, ALIGN=aligns[0],
                  Q_ALIGN=aligns[1], num_warps=4)
    # CPU tensors: Triton's interpreter (TRITON_INTERPRET=1), for tests without a GPU
    cuda = like.device.type == "cuda"
    with torch.cuda.device(like.device) if cuda else contextlib.nullcontext():
        _quantize_blocks[(count, *blocks)](*args, **consts)


def launch_table(at: tuple[np.ndarray, np.ndarray, np.ndarray], marks: np.ndarray,
                 counts: list[int]) -> tuple[np.ndarray, tuple[int, int], tuple[int, int]]:
    """The table of one `launch` per group of `counts[g]` tensors, from and to the addresses
    in `at` (inputs, e4m3 values, scales; the groups one after another), group g marking as
    `marks[g]` says (flag address, status address, base, value): per group its inputs, its
    values' and scales' offsets and its marks; the bases of those offsets and the inputs' and
    values' alignments."""
    (q_base, q_off), (s_base, s_off) = offsets(at[1], 1), offsets(at[2], 4)
    tables, first = [], 0
    for count, row in zip(counts, marks, strict=True):
        part = slice(first, first + count)
        tables += [at[0][part], q_off[part], s_off[part], row]
        first += count
    return (np.concatenate(tables), (q_base, s_base),
            (alignment(at[0]), alignment(q_off)))


def launch_all(table: torch.Tensor, likes: list[Like], counts: list[int],
               bases: tuple[int, int], aligns: tuple[int, int], block: tuple[int, int],
               ue8m0: bool) -> None:
    """One `launch` per group, reading the `launch_table` uploaded as `table`."""
    offset = 0
    for like_, count in zip(likes, counts, strict=True):
        end = offset + 3 * count
        launch(table[offset:end], count, aligns, like_, block, ue8m0, table[end:end + 4],
               bases)
        offset = end + 4


def launch_groups(likes: list[torch.Tensor], counts: list[int],
                  at: tuple[np.ndarray, np.ndarray, np.ndarray], marks: np.ndarray,
                  block: tuple[int, int], ue8m0: bool) -> None:
    """One `launch` per group of `counts[g]` tensors like `likes[g]` (`launch_table`), every
    table in one upload."""
    _launch_uploaded(list(map(like, likes)), counts, at, marks, block, ue8m0)


def _launch_uploaded(likes: list[Like], counts: list[int],
                     at: tuple[np.ndarray, np.ndarray, np.ndarray], marks: np.ndarray,
                     block: tuple[int, int], ue8m0: bool) -> None:
    table, bases, aligns = launch_table(at, marks, counts)
    launch_all(upload(table, likes[0].device), likes, counts, bases, aligns, block, ue8m0)


class QuantizeLaunches:
    """The launches of one set of groups (`counts[g]` tensors like `likes[g]`) whose addresses
    mostly stay put (a frame's slots, a dict's tensors): on CUDA their table lives on the
    device, uploaded when it changes (`DeviceTable`), and they replay as one CUDA graph per
    pair of bases (a few at most; beyond, eager launches). Elsewhere (Triton's interpreter)
    each run uploads its table and launches."""

    MAX_GRAPHS = 4

    def __init__(self, likes: list[Like], counts: list[int], block: tuple[int, int],
                 ue8m0: bool) -> None:
        self.likes, self.counts, self.block, self.ue8m0 = likes, counts, block, ue8m0
        device = likes[0].device
        self.table = (DeviceTable(sum(3 * c + 4 for c in counts), device)
                      if device.type == "cuda" else None)
        self.graphs: dict[tuple, torch.cuda.CUDAGraph | None] = {}

    def run(self, at: tuple[np.ndarray, np.ndarray, np.ndarray], marks: np.ndarray) -> None:
        """Quantize from and to the addresses `at`, marking as `marks` says (`launch_table`)."""
        if self.table is None:
            _launch_uploaded(self.likes, self.counts, at, marks, self.block, self.ue8m0)
            return
        key = self.stage(at, marks)
        with torch.cuda.device(self.table.device_index):
            replay_or_launch(self.graphs, key, lambda: self.launch(key), "FP8 quantize",
                             self.MAX_GRAPHS)

    def stage(self, at: tuple[np.ndarray, np.ndarray, np.ndarray], marks: np.ndarray) -> tuple:
        """Make the table of `at` and `marks` what the next launches read (CUDA); returns
        their key: the bases and alignments the launches take as arguments."""
        table, bases, aligns = launch_table(at, marks, self.counts)
        self.table.stage(table, table.tobytes())
        return bases, aligns

    def launch(self, key: tuple) -> None:
        """The launches for `key` (`stage`), reading the staged table when they run."""
        launch_all(self.table.words, self.likes, self.counts, *key, self.block, self.ue8m0)

    def compiled(self, key: tuple) -> bool:
        """Whether the launches for `key` have run (their kernels compiled)."""
        return key in self.graphs


def quantize(x: torch.Tensor, block: tuple[int, int],
             ue8m0: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 values of x's shape, float32 scale_inv per block) of the 2-D CUDA tensor `x`
    (the caller checks the scales)."""
    (m, n), (bm, bn) = x.shape, block
    q = torch.empty((m, n), dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty((triton.cdiv(m, bm), triton.cdiv(n, bn)), dtype=torch.float32,
                    device=x.device)
    scratch = torch.zeros(1, dtype=torch.int64, device=x.device)  # its marks, unread
    at = tuple(np.array([t.data_ptr()], dtype=np.int64) for t in (x, q, s))
    launch_groups([x], [1], at, np.array([[scratch.data_ptr()] * 2 + [1, 1]], dtype=np.int64),
                  block, ue8m0)
    return q, s
