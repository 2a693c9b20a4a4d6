"""End-to-end payload checksums: each bucket's bytes as the sender packed them, checked by
every receiver on the bytes it received, before anything is loaded.

CRC-32 (zlib; it covers every byte and is position-sensitive: a flipped or a swapped byte
changes it) on CPU groups, where it runs at several times a memcpy's speed and releases the
GIL. The sender writes it into the bucket's header; a receiver whose bytes disagree stops
loading and the refit fails on every rank at the status exchange, naming the bucket, its
tensors and the receiver. CUDA groups send no checksum yet (the header says so).
"""

from __future__ import annotations

import zlib

import torch

from common.wire import CHECKSUM_OFFSET


def supported(device: torch.device) -> bool:
    return device.type == "cpu"


def crc32(payload: torch.Tensor) -> int:
    """CRC-32 of a contiguous uint8 CPU tensor's bytes."""
    return zlib.crc32(memoryview(payload.numpy()))


def stamp(header: torch.Tensor, payload: torch.Tensor) -> None:
    """Write `payload`'s checksum into the encoded header `header` (uint8, CPU), in place."""
    value = crc32(payload)
    header[CHECKSUM_OFFSET:CHECKSUM_OFFSET + 8].copy_(
        torch.frombuffer(bytearray(value.to_bytes(8, "little")), dtype=torch.uint8))
