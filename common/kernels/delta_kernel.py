"""CUDA kernels of `common.delta.codec` (Triton): a reduce-then-scan encode and rebuild, each
reading the payload's words once and with no host sync but the caller's one per payload.

Encode (`encode`): pass 1 reads the new and base words once; each block of BLOCK words
writes its bitmask bytes, its changed-word count, and its changed words compacted at the
start of its own stretch of a staging area; a prefix sum of the counts (one small scan)
gives each block's first value slot; pass 2 moves each block's staged words (only those:
3% of a block at 3% density) to their slots, and its last program writes the whole preamble
(the changed-word count included). The delta is laid out in a scratch buffer on the device
without any host data; the caller reads the count back (the one host sync) and copies the
delta's bytes into a tensor of its size.

Rebuild (`count`, then `rebuild`): the count pass reads the bitmask alone (a popcount per
block), a scan gives each block's slots, and the preamble, the marked-word total and the
bitmask's last byte come back to the host together (the one host sync), so every check is
made before the scatter pass writes a word.

(A single-pass encode with a decoupled look-back across blocks measured 0.77 ms per 256 MiB
bucket on an H200, 5.6x a copy: Triton's block-wide reductions make each look-back step
slow, and a thousand resident blocks each walk back far; this two-pass form stays at the
memory's speed.)
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - machines without Triton use the torch ops
    triton = None

BLOCK = 4096  # words per block (a multiple of 128: the blocks cover the padding to 16 B)
WARPS = 4  # of the compare and scatter passes
MOVE_CHUNK = 256  # staged words of each block a pass-2 step moves
MOVE_BLOCKS = 16  # blocks per pass-2 program
COUNT_BLOCKS = 8  # blocks per count program
PREAMBLE_BYTES = 64


def available(device: torch.device) -> bool:
    return triton is not None and device.type == "cuda"


def _blocks(words: int) -> int:
    return max(1, -(-words // BLOCK))


if triton is not None:

    @triton.jit
    def _compare(new, base, mask, counts, staged, n_words, n_pad, BLOCK: tl.constexpr):
        """Words as (BLOCK // 8, 8): a row per bitmask byte; a word's rank among the block's
        changed words is the changed words of the rows before and of its row before it."""
        block = tl.program_id(0).to(tl.int64)
        r = tl.arange(0, BLOCK // 8)
        j = tl.arange(0, 8)
        offs = block * BLOCK + r[:, None] * 8 + j[None, :]
        inb = offs < n_words
        a = tl.load(new + offs, mask=inb, other=0)
        b = tl.load(base + offs, mask=inb, other=0)
        d = ((a != b) & inb).to(tl.int32)
        boffs = block * (BLOCK // 8) + r
        byte = tl.sum(d << j[None, :], axis=1)
        tl.store(mask + boffs, byte.to(tl.uint8), mask=boffs < n_pad)  # the padding too
        row = tl.sum(d, axis=1)
        tl.store(counts + block, tl.sum(row, axis=0))
        rank = (tl.cumsum(row, axis=0) - row)[:, None] + tl.cumsum(d, axis=1) - 1
        tl.store(staged + (block * BLOCK + rank), a, mask=d != 0)

    @triton.jit(do_not_specialize=["base_version", "n_bytes", "n_mask"])
    def _place(staged, counts, ends, values, tail, head, n_blocks, base_version, n_bytes,
               n_mask, HEAD0: tl.constexpr, HAS_TAIL: tl.constexpr, BLOCK: tl.constexpr,
               BLOCKS: tl.constexpr, CHUNK: tl.constexpr):
        pid = tl.program_id(0)
        rows = pid.to(tl.int64) * BLOCKS + tl.arange(0, BLOCKS)
        c = tl.load(counts + rows, mask=rows < n_blocks, other=0)
        first = tl.load(ends + rows, mask=rows < n_blocks, other=0) - c
        for lo in range(0, tl.max(c, axis=0), CHUNK):
            k = lo + tl.arange(0, CHUNK)[None, :]
            m = k < c[:, None]
            v = tl.load(staged + (rows[:, None] * BLOCK + k), mask=m)
            tl.store(values + (first[:, None] + k), v, mask=m)
        if pid == tl.num_programs(0) - 1:  # the preamble
            w = tl.arange(0, 8)
            total = tl.load(ends + (n_blocks - 1))
            t = total * 0
            if HAS_TAIL:
                t += tl.load(tail).to(tl.int64)
            word = tl.where(w == 0, HEAD0, 0).to(tl.int64)
            word = tl.where(w == 1, base_version.to(tl.int64), word)
            word = tl.where(w == 2, n_bytes.to(tl.int64), word)
            word = tl.where(w == 3, total, word)
            word = tl.where(w == 4, n_mask.to(tl.int64), word)
            word = tl.where(w == 5, t, word)
            tl.store(head + w, word)

    @triton.jit
    def _count(mask, counts, n_mask, n_blocks, BLOCK: tl.constexpr, BLOCKS: tl.constexpr):
        rows = tl.program_id(0).to(tl.int64) * BLOCKS + tl.arange(0, BLOCKS)
        offs = rows[:, None] * (BLOCK // 8) + tl.arange(0, BLOCK // 8)[None, :]
        x = tl.load(mask + offs, mask=offs < n_mask, other=0).to(tl.int32)
        x = x - ((x >> 1) & 0x55)  # popcount of each byte
        x = (x & 0x33) + ((x >> 2) & 0x33)
        x = (x + (x >> 4)) & 0x0F
        tl.store(counts + rows, tl.sum(x, axis=1), mask=rows < n_blocks)

    @triton.jit
    def _scatter(words, mask, counts, ends, values, n_words, BLOCK: tl.constexpr):
        block = tl.program_id(0).to(tl.int64)
        offs = block * BLOCK + tl.arange(0, BLOCK)
        inb = offs < n_words
        byte = tl.load(mask + (offs >> 3), mask=inb, other=0).to(tl.int32)
        d = ((byte >> (offs & 7).to(tl.int32)) & 1) != 0
        first = tl.load(ends + block) - tl.load(counts + block)
        slot = first + tl.cumsum(d.to(tl.int32), axis=0) - 1
        tl.store(words + offs, tl.load(values + slot, mask=d, other=0), mask=d)


def encode(new: torch.Tensor, base: torch.Tensor, head0: int, base_version: int,
           mask_bytes: int) -> tuple[torch.Tensor, int]:
    """The delta of the uint8 payload `new` on `base` laid out in a scratch buffer of the
    largest delta's size (preamble with `head0` its first 8 bytes, bitmask, values; then the
    staging area), and the changed-word count (the one host sync): the delta is the buffer's
    first bytes."""
    n = new.numel()
    words = n // 2
    start = PREAMBLE_BYTES + -(-mask_bytes // 16) * 16
    blocks = _blocks(words)
    scratch = torch.empty(start + 2 * words + 2 * blocks * BLOCK, dtype=torch.uint8,
                          device=new.device)
    counts = torch.empty(blocks, dtype=torch.int32, device=new.device)
    staged = scratch[start + 2 * words :].view(torch.int16)
    _compare[(blocks,)](new[: 2 * words].view(torch.int16), base[: 2 * words].view(torch.int16),
                        scratch[PREAMBLE_BYTES:start], counts, staged, words,
                        start - PREAMBLE_BYTES, BLOCK=BLOCK, num_warps=WARPS)
    ends = torch.cumsum(counts, 0)
    head = scratch[:PREAMBLE_BYTES].view(torch.int64)
    _place[(-(-blocks // MOVE_BLOCKS),)](
        staged, counts, ends, scratch[start : start + 2 * words].view(torch.int16),
        new[n - 1 :] if n % 2 else new, head, blocks, base_version, n, mask_bytes,
        HEAD0=head0, HAS_TAIL=n % 2 == 1, BLOCK=BLOCK, BLOCKS=MOVE_BLOCKS, CHUNK=MOVE_CHUNK,
        num_warps=4)
    return scratch, int(head[3])


def count(delta: torch.Tensor, words: int) -> tuple[bytes, torch.Tensor, torch.Tensor]:
    """For a delta of a payload of `words` (> 0) words, its size checked to fit that by the
    caller: (its first 64 bytes, the marked-word total as 8 little-endian bytes and its
    bitmask's last byte, read back in the one host sync), each block's marked words and the
    running total of those."""
    mask_bytes = -(-words // 8)
    blocks = _blocks(words)
    mask = delta[PREAMBLE_BYTES : PREAMBLE_BYTES + mask_bytes]
    counts = torch.empty(blocks, dtype=torch.int32, device=delta.device)
    _count[(-(-blocks // COUNT_BLOCKS),)](mask, counts, mask_bytes, blocks, BLOCK=BLOCK,
                                          BLOCKS=COUNT_BLOCKS)
    ends = torch.cumsum(counts, 0)
    info = torch.cat([delta[:PREAMBLE_BYTES], ends[-1:].view(torch.uint8), mask[-1:]])
    return info.cpu().numpy().tobytes(), counts, ends


def rebuild(target: torch.Tensor, mask: torch.Tensor, counts: torch.Tensor, ends: torch.Tensor,
            values: torch.Tensor) -> None:
    """The marked int16 words of `target` from `values`, in order (`counts`, `ends`:
    `count`'s)."""
    n = target.numel()
    _scatter[(_blocks(n),)](target, mask, counts, ends, values, n, BLOCK=BLOCK,
                            num_warps=WARPS)
