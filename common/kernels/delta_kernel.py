"""CUDA kernels of `common.delta` (Triton): compare, compact and rebuild in two passes each.

Encode: pass 1 compares the new and base words of each block, writes the block's bitmask
bytes and its changed-word count; an exclusive prefix sum of the counts gives each block's
first value slot; pass 2 reads the bitmask and the new words and stores the changed ones at
their slots. Rebuild: pass 1 counts each block's marked words; pass 2 loads each marked
word's value from its slot and stores it into the target. No host sync but the one the caller
makes for the changed-word count.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - machines without Triton use the torch ops
    triton = None

BLOCK = 4096  # words per program (a multiple of 8: whole bitmask bytes)


def available(device: torch.device) -> bool:
    return triton is not None and device.type == "cuda"


if triton is not None:

    @triton.jit
    def _bits(mask, pid, n_mask, BLOCK: tl.constexpr):
        """The block's bits, one per word: its bitmask bytes loaded once and spread (bits
        past the last word are 0: the caller checked the last byte)."""
        boffs = pid * (BLOCK // 8) + tl.arange(0, BLOCK // 8)
        byte = tl.load(mask + boffs, mask=boffs < n_mask, other=0).to(tl.int32)
        return tl.reshape((byte[:, None] >> tl.arange(0, 8)[None, :]) & 1, (BLOCK,)) != 0

    @triton.jit
    def _compare(new, base, mask, counts, n_words, n_mask, BLOCK: tl.constexpr):
        pid = tl.program_id(0)
        offs = pid * BLOCK + tl.arange(0, BLOCK)
        inb = offs < n_words
        a = tl.load(new + offs, mask=inb, other=0)
        b = tl.load(base + offs, mask=inb, other=0)
        d = ((a != b) & inb).to(tl.int32)
        tl.store(counts + pid, tl.sum(d, axis=0))
        byte = tl.sum(tl.reshape(d, (BLOCK // 8, 8)) << tl.arange(0, 8)[None, :], axis=1)
        boffs = pid * (BLOCK // 8) + tl.arange(0, BLOCK // 8)
        tl.store(mask + boffs, byte.to(tl.uint8), mask=boffs < n_mask)

    @triton.jit
    def _count(mask, counts, n_mask, BLOCK: tl.constexpr):
        pid = tl.program_id(0)
        tl.store(counts + pid, tl.sum(_bits(mask, pid, n_mask, BLOCK).to(tl.int32), axis=0))

    @triton.jit
    def _move(words, mask, firsts, values, n_mask, GATHER: tl.constexpr,
              BLOCK: tl.constexpr):
        """GATHER: changed words -> their value slots (encode); else back (rebuild)."""
        pid = tl.program_id(0)
        offs = pid * BLOCK + tl.arange(0, BLOCK)
        d = _bits(mask, pid, n_mask, BLOCK)
        slot = tl.load(firsts + pid) + tl.cumsum(d.to(tl.int32), axis=0) - 1
        if GATHER:
            tl.store(values + slot, tl.load(words + offs, mask=d, other=0), mask=d)
        else:
            tl.store(words + offs, tl.load(values + slot, mask=d, other=0), mask=d)


def _firsts(counts: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Each block's first value slot, and the total (the one host sync)."""
    ends = torch.cumsum(counts, 0)
    return ends - counts, int(ends[-1]) if counts.numel() else 0


def compare(new: torch.Tensor, base: torch.Tensor,
            mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int16 words `new` vs `base`: the bitmask into `mask` (uint8); (the changed words, in
    order, and their count)."""
    n = new.numel()
    grid = (triton.cdiv(n, BLOCK),)
    counts = torch.empty(grid[0], dtype=torch.int64, device=new.device)
    _compare[grid](new, base, mask, counts, n, mask.numel(), BLOCK=BLOCK)
    firsts, total = _firsts(counts)
    values = torch.empty(total, dtype=torch.int16, device=new.device)
    if total:
        _move[grid](new, mask, firsts, values, mask.numel(), GATHER=True, BLOCK=BLOCK)
    return values, total


def count(mask: torch.Tensor, words: int) -> tuple[torch.Tensor, int]:
    """(each block's first value slot, the words `mask` marks; bits past the first `words`
    must be 0: the caller checks the last byte)."""
    grid = (triton.cdiv(words, BLOCK),)
    counts = torch.empty(grid[0], dtype=torch.int64, device=mask.device)
    _count[grid](mask, counts, mask.numel(), BLOCK=BLOCK)
    return _firsts(counts)


def rebuild(target: torch.Tensor, mask: torch.Tensor, firsts: torch.Tensor,
            values: torch.Tensor) -> None:
    """The marked int16 words of `target` from `values`, in order."""
    n = target.numel()
    if n:
        _move[(triton.cdiv(n, BLOCK),)](target, mask, firsts, values, mask.numel(),
                                        GATHER=False, BLOCK=BLOCK)
