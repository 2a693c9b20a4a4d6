"""Lossless deltas of a payload against the bytes a receiver already holds (its base).

A delta compares the new bytes with the base in 2-byte words, bit for bit (exact for bf16,
fp16 and fp32 alike: a changed fp32 element is one or two changed words), and carries a
bitmask of the changed words plus their new values, in order:

    [preamble 64 B | bitmask: one bit per word, padded to 16 B | values: 2 B per changed word]

The preamble says which version the delta applies on top of, how many payload bytes it
rebuilds, how many words changed and, for an odd length, the last byte. `encode` returns None
where the delta would not be smaller than the payload (the payload then goes whole). `apply`
checks everything it can before it writes a byte: the preamble, the sizes, the base version
and that the bitmask marks exactly as many words as there are values; a malformed or
truncated delta is refused with the reason (`DeltaError`) and the target is untouched.
One pass of C++ over the words on CPU (`common.kernels.native`; torch ops where it is not
built), Triton kernels on CUDA (`common.kernels.delta_kernel`), the same format: one host
sync per payload (its changed-word count), none per tensor.
"""

from __future__ import annotations

import struct

import torch

from common.errors import RefitError
from common.kernels import delta_kernel, native

MAGIC = 0x4C444652  # "RFDL"
FORMAT = 1
PREAMBLE_BYTES = 64
_PREAMBLE = struct.Struct("<IIqQQQI")  # magic, format, base version, nbytes, changed, mask, tail
_SHIFTS = {}  # device -> the 8 bit positions, as uint8
_HEAD0 = MAGIC | FORMAT << 32  # the preamble's first 8 bytes, as a little-endian int64


class DeltaError(RefitError):
    """A delta that cannot apply to its target (the reason says what); nothing was written."""


def _align16(n: int) -> int:
    return -(-n // 16) * 16


def delta_bytes(nbytes: int, changed: int) -> int:
    """The size of a delta of a `nbytes` payload with `changed` changed words."""
    return PREAMBLE_BYTES + _align16(-(-(nbytes // 2) // 8)) + 2 * changed


def _words(raw: torch.Tensor) -> torch.Tensor:
    return raw[: raw.numel() // 2 * 2].view(torch.int16)


def _shifts(device: torch.device) -> torch.Tensor:
    if device not in _SHIFTS:
        _SHIFTS[device] = torch.arange(8, dtype=torch.uint8, device=device)
    return _SHIFTS[device]


def encode(new: torch.Tensor, base: torch.Tensor, base_version: int) -> torch.Tensor | None:
    """The delta turning `base` into `new` (equal-length uint8 tensors on one device), or
    None if it would not be smaller than `new`."""
    if new.shape != base.shape or new.dtype != torch.uint8 or base.dtype != torch.uint8:
        raise ValueError(f"delta of {tuple(new.shape)} {new.dtype} against "
                         f"{tuple(base.shape)} {base.dtype}: uint8 tensors of one length")
    n = new.numel()
    mask_bytes = -(-(n // 2) // 8)
    if delta_bytes(n, 0) >= n:  # no delta of so few bytes is smaller
        return None
    if delta_kernel.available(new.device):
        scratch, changed = delta_kernel.encode(new, base, _HEAD0, base_version, mask_bytes)
        size = delta_bytes(n, changed)
        return None if size >= n else scratch[:size].clone()
    mask, values = _compare(_words(new), _words(base), mask_bytes)
    changed = values.numel()
    size = delta_bytes(n, changed)
    if size >= n:
        return None
    out = torch.zeros(size, dtype=torch.uint8, device=new.device)
    out[PREAMBLE_BYTES : PREAMBLE_BYTES + mask_bytes] = mask
    out[size - 2 * changed :] = values.view(torch.uint8)
    tail = int(new[-1]) if n % 2 else 0
    head = _PREAMBLE.pack(MAGIC, FORMAT, base_version, n, changed, mask_bytes, tail)
    out[: len(head)] = torch.frombuffer(bytearray(head), dtype=torch.uint8).to(new.device)
    return out


def _compare(new: torch.Tensor, base: torch.Tensor,
             mask_bytes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(the bitmask of the words that differ, their new values in order)."""
    mask = torch.zeros(mask_bytes, dtype=torch.uint8, device=new.device)
    if new.device.type == "cpu" and (module := native.load()):
        values = torch.empty(module.delta_mask(new, base, mask), dtype=torch.int16)
        module.delta_gather(new, mask, values)
        return mask, values
    diff = new != base
    bits = torch.zeros(mask_bytes * 8, dtype=torch.uint8, device=new.device)
    bits[: diff.numel()] = diff
    mask = (bits.view(-1, 8) << _shifts(new.device)).sum(1, dtype=torch.uint8)
    return mask, torch.masked_select(new, diff)  # the one host sync: its length


def read_preamble(delta: torch.Tensor) -> tuple[int, int, int, int, int]:
    """(base version, payload bytes, changed words, bitmask bytes, tail byte) of a delta."""
    if delta.numel() < PREAMBLE_BYTES:
        raise DeltaError(f"a delta of {delta.numel()} bytes is shorter than its preamble")
    return _parse(delta[: _PREAMBLE.size].cpu().numpy().tobytes())


def _parse(raw: bytes) -> tuple[int, int, int, int, int]:
    magic, fmt, base, nbytes, changed, mask_bytes, tail = _PREAMBLE.unpack(raw[: _PREAMBLE.size])
    if magic != MAGIC or fmt != FORMAT:
        raise DeltaError(f"not a refit delta (magic {magic:#x}, format {fmt})")
    return base, nbytes, changed, mask_bytes, tail


def _count_on_device(delta: torch.Tensor, target: torch.Tensor) -> tuple | None:
    """On CUDA, where `delta`'s size fits a delta of `target`'s size: (its preamble's bytes,
    the words its bitmask marks, the marks past the last word, and for the rebuild each
    block's marked words and their running total), read back in one host sync before any
    check; else None."""
    if not delta_kernel.available(delta.device) or target.device != delta.device:
        return None
    words = target.numel() // 2
    spare = delta.numel() - delta_bytes(target.numel(), 0)
    if not words or spare < 0 or spare % 2 or target.dtype != torch.uint8:
        return None
    raw, counts, ends = delta_kernel.count(delta, words)
    marked, last = struct.unpack_from("<qB", raw, PREAMBLE_BYTES)
    return raw, marked, last >> (words % 8) if words % 8 else 0, (counts, ends)


def apply(delta: torch.Tensor, target: torch.Tensor, base_version: int) -> int:
    """Rebuild the new payload in `target` (the base, uint8, same device) in place; returns
    the number of changed words. Every check comes before the first write."""
    counted = _count_on_device(delta, target)
    if counted is None:
        base, nbytes, changed, mask_bytes, tail = read_preamble(delta)
    else:
        base, nbytes, changed, mask_bytes, tail = _parse(counted[0])
    where = f"a delta on v{base} of {nbytes} bytes"
    if base != base_version:
        raise DeltaError(f"{where} cannot apply: this receiver holds v{base_version}")
    if nbytes != target.numel() or target.dtype != torch.uint8:
        raise DeltaError(f"{where} cannot apply to a target of {target.numel()} bytes")
    words = nbytes // 2
    if mask_bytes != -(-words // 8) or delta.numel() != delta_bytes(nbytes, changed):
        raise DeltaError(f"{where} is malformed or truncated: {delta.numel()} bytes for "
                         f"{changed} changed words and a {mask_bytes}-byte bitmask")
    mask = delta[PREAMBLE_BYTES : PREAMBLE_BYTES + mask_bytes]
    values = delta[delta.numel() - 2 * changed :].view(torch.int16)
    if counted is None:
        beyond = int(mask[-1]) >> (words % 8) if words % 8 else 0  # marks past the last word
    if counted is not None:
        marked, beyond, (counts, ends) = counted[1:]
        if marked == changed and not beyond:
            delta_kernel.rebuild(_words(target), mask, counts, ends, values)
    elif delta_kernel.available(delta.device):  # the sizes fit, so only the place differs
        raise DeltaError(f"{where} on {delta.device} cannot apply to a target on "
                         f"{target.device}")
    elif delta.device.type == "cpu" and (module := native.load()):
        marked = module.delta_count(mask)
        if marked == changed and not beyond:
            module.delta_scatter(_words(target), mask, values)
    else:
        bits = ((mask.view(-1, 1) >> _shifts(delta.device)) & 1).view(-1)[:words].bool()
        marked = int(bits.sum())
        if marked == changed and not beyond:
            _words(target).masked_scatter_(bits, values)
    if marked != changed or beyond:
        past = " (and bits past the end)" if beyond else ""
        raise DeltaError(f"{where} is malformed: its bitmask marks {marked} words{past} for "
                         f"{changed} values")
    if nbytes % 2:
        target[-1] = tail
    return changed
