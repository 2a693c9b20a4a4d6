"""Block-scaled FP8 (e4m3, DeepSeek-V3 style): the format of an engine's FP8 checkpoint.

A trainer quantizes its bf16 weights with `quantize` and sends the fp8 weight and its
`weight_scale_inv` (float32, one per block, weight = fp8 * scale_inv), so an FP8 engine loads
them like its checkpoint. `quantize` reproduces vLLM's `per_block_cast_to_fp8` bit for bit (the
same float operations in the same order) but works on bounded row chunks and splits off the
partial last block row and column instead of zero-padding a copy of the whole tensor: zeros never
raise a block's amax, and the clamp still applies to all-zero blocks. CUDA tensors go through
one Triton pass (`common.kernels.fp8_kernel`: the same operations as torch's on CUDA, where a
division by a host scalar is a multiplication by its reciprocal). No vllm import here. vLLM
wraps the reference in torch.compile: on CPU its generated code does these same operations; on
CUDA, Triton's approximate fp32 division may differ from its eager ops.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from common.kernels import fp8_kernel

INPUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@dataclass(frozen=True)
class BlockFp8Format:
    """e4m3 weights with one float32 scale per `block` (rows, cols) tile.

    `ue8m0`: scales rounded up to powers of two, as DeepGEMM's UE8M0 kernels want.
    `keep_unquantized`: module names the checkpoint leaves in bf16 (vLLM matches them exactly
    against layer prefixes)."""

    block: tuple[int, int] = (128, 128)
    ue8m0: bool = False
    keep_unquantized: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        block = tuple(self.block)
        if len(block) != 2 or not all(isinstance(b, int) and b > 0 for b in block):
            raise ValueError(f"block must be two positive ints, got {self.block!r}")
        object.__setattr__(self, "block", block)
        object.__setattr__(self, "keep_unquantized", tuple(self.keep_unquantized))

    @property
    def dtype(self) -> torch.dtype:
        return torch.float8_e4m3fn

    def scale_shape(self, shape: tuple[int, ...] | torch.Size) -> tuple[int, int]:
        """Blocks per dim, the last one partial (how vLLM sizes `weight_scale_inv`)."""
        rows, cols = shape
        return -(-rows // self.block[0]), -(-cols // self.block[1])

    def describe(self) -> str:
        scales = "ue8m0 (power-of-two) scales" if self.ue8m0 else "float32 scales"
        return f"fp8 e4m3 in {self.block[0]}x{self.block[1]} blocks, {scales}"

    @classmethod
    def from_quantization_config(cls, cfg: dict[str, Any] | None) -> BlockFp8Format | None:
        """The format of a HF config.json's `quantization_config`, read as vLLM's `Fp8Config`
        reads it; None without one. Raises ValueError for any other quantization (per-tensor
        FP8 included): refit would send weights the engine does not expect."""
        if cfg is None:
            return None
        method = cfg.get("quant_method")
        if method is None:
            raise ValueError(f"quantization_config has no quant_method: {sorted(cfg)}")
        if method != "fp8":
            raise ValueError(f"quant_method {method!r} is not supported: only block-scaled "
                             "FP8 (quant_method 'fp8' with weight_block_size) is")
        block = cfg.get("weight_block_size")
        if block is None:
            raise ValueError("per-tensor FP8 (quant_method 'fp8' without weight_block_size) is "
                             "not supported: only block-scaled FP8 is")
        if len(block) != 2:
            raise ValueError(f"weight_block_size must have 2 dims, got {block!r}")
        if "activation_scheme" not in cfg:
            raise ValueError("quantization_config has no activation_scheme")
        if cfg["activation_scheme"] != "dynamic":
            raise ValueError("block-scaled FP8 needs activation_scheme 'dynamic', got "
                             f"{cfg['activation_scheme']!r}")
        if cfg.get("store_dtype") is not None:
            raise ValueError(f"store_dtype {cfg['store_dtype']!r} (experts stored in another "
                             "format) is not supported")
        ignored = cfg.get("ignored_layers") or cfg.get("modules_to_not_convert") or ()
        return cls(block=tuple(int(b) for b in block), ue8m0=cfg.get("scale_fmt") == "ue8m0",
                   keep_unquantized=tuple(ignored))


def _scale_region(x: torch.Tensor, q: torch.Tensor, s: torch.Tensor, bm: int, bn: int,
                  fmt: BlockFp8Format) -> None:
    """Quantize a region of whole (bm, bn) tiles into `q`, its scales into `s`: the reference's
    operations on the reference's 4-D view."""
    if x.numel() == 0:
        return
    shape = (x.size(0) // bm, bm, x.size(1) // bn, bn)
    xv = x.view(shape)
    # max is exact, so reducing before the float cast (a smaller temporary) changes no bit
    amax = xv.abs().amax(dim=(1, 3), keepdim=True).float().clamp(1e-4)
    sf = amax / torch.finfo(fmt.dtype).max
    if fmt.ue8m0:
        sf = torch.pow(2.0, torch.ceil(torch.log2(sf.abs())))
    q.view(shape).copy_(xv * (1.0 / sf))
    s.copy_(sf.view(sf.size(0), sf.size(2)))


def quantize(name: str, x: torch.Tensor, fmt: BlockFp8Format, *,
             chunk_elems: int = 1 << 23) -> tuple[torch.Tensor, torch.Tensor]:
    """`x` (2-D bf16, fp16 or fp32) as (fp8 of x's shape, float32 scale_inv of
    `fmt.scale_shape`), equal bit for bit to vLLM's `per_block_cast_to_fp8`.

    Works `chunk_elems` input elements (whole block rows, at least one) at a time, so temporary
    memory stays near 8 bytes per chunk element whatever the tensor's size. An empty tensor
    gives empty results. Raises ValueError naming `name` for another rank or dtype, or for
    NaN / inf values (after the pass: a block's scale is non-finite exactly then)."""
    if x.dim() != 2:
        raise ValueError(f"{name}: block FP8 quantizes 2-D weights, got shape {tuple(x.shape)}")
    if x.dtype not in INPUT_DTYPES:
        raise ValueError(f"{name}: block FP8 quantizes bf16, fp16 or fp32, got {x.dtype}")
    if fp8_kernel.available(x, fmt.block):
        q, s = fp8_kernel.quantize(x, fmt.block, fmt.ue8m0)
    else:
        q, s = _quantize_in_chunks(x, fmt, chunk_elems)
    if not bool(torch.isfinite(s).all()):
        step = max(1, chunk_elems // (fmt.block[0] * max(x.size(1), 1))) * fmt.block[0]
        raise ValueError(f"{name}: {nonfinite_summary(x, step)}; cannot quantize to FP8")
    return q, s


def _quantize_in_chunks(x: torch.Tensor, fmt: BlockFp8Format,
                        chunk_elems: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch ops of `quantize`, a bounded number of block rows at a time."""
    (m, n), (bm, bn) = x.shape, fmt.block
    q = torch.empty((m, n), dtype=fmt.dtype, device=x.device)
    s = torch.empty(fmt.scale_shape((m, n)), dtype=torch.float32, device=x.device)
    m_full, n_full = m - m % bm, n - n % bn
    step = max(1, chunk_elems // (bm * max(n, 1))) * bm
    rows = [(r, min(r + step, m_full), bm) for r in range(0, m_full, step)]
    if m_full < m:
        rows.append((m_full, m, m - m_full))
    cols = [(0, n_full, bn), (n_full, n, n - n_full)]
    for r0, r1, h in rows:
        for c0, c1, w in cols:
            _scale_region(x[r0:r1, c0:c1], q[r0:r1, c0:c1],
                          s[r0 // bm:-(-r1 // bm), c0 // bn:-(-c1 // bn)], h, w, fmt)
    return q, s


def nonfinite_summary(x: torch.Tensor, step: int) -> str:
    """How many NaN and inf values `x` holds and where the first is, in bounded row chunks."""
    nans = infs = 0
    first = None
    for r0 in range(0, x.size(0), step):
        part = x[r0:r0 + step]
        nans += int(torch.isnan(part).sum())
        infs += int(torch.isinf(part).sum())
        if first is None:
            bad = (~torch.isfinite(part)).nonzero()
            if bad.numel():
                first = (r0 + int(bad[0, 0]), int(bad[0, 1]))
    return f"{nans} NaN and {infs} inf values in {tuple(x.shape)} {x.dtype}, the first at {first}"


def dequantize(q: torch.Tensor, scale_inv: torch.Tensor, fmt: BlockFp8Format) -> torch.Tensor:
    """float32 weight = fp8 * its block's scale_inv (for checks and tests)."""
    if q.dim() != 2 or q.dtype != fmt.dtype:
        raise ValueError(f"expected a 2-D {fmt.dtype} tensor, got {q.dtype} {tuple(q.shape)}")
    if tuple(scale_inv.shape) != fmt.scale_shape(q.shape):
        raise ValueError(f"scale_inv shape {tuple(scale_inv.shape)} does not match "
                         f"{fmt.scale_shape(q.shape)} for weight {tuple(q.shape)}")
    bm, bn = fmt.block
    s = scale_inv.float().repeat_interleave(bm, 0).repeat_interleave(bn, 1)
    return q.float() * s[: q.size(0), : q.size(1)]
