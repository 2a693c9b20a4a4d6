"""End-to-end payload checksums: each bucket's bytes as the sender packed them, checked by
every receiver on the bytes it received, before anything is loaded.

On CPU groups CRC-32 (zlib; it releases the GIL); on CUDA groups a 64-bit position-sensitive
hash computed on the device (`common.kernels.hash_kernel`), which the sender stamps into the header
without waiting for the GPU. Both cover every byte and change when a byte flips or two bytes
swap. A receiver whose bytes disagree stops loading and the refit fails on every rank at the
status exchange, naming the bucket, its tensors and the receiver.
"""

from __future__ import annotations

import zlib

import torch

from common.kernels import hash_kernel
from common.wire.bucket_header import CHECKSUM_OFFSET


def supported(device: torch.device) -> bool:
    return device.type == "cpu" or hash_kernel.available(device)


def name(device: torch.device) -> str:
    return "CRC-32" if device.type == "cpu" else "hash64"


def compute(payload: torch.Tensor) -> int:
    """The checksum of a contiguous uint8 tensor's bytes, as an unsigned 64-bit int."""
    if payload.device.type == "cpu":
        return zlib.crc32(memoryview(payload.numpy()))
    return hash_kernel.device_hash(payload).item() % (1 << 64)


def stamp(header: torch.Tensor, payload: torch.Tensor) -> None:
    """Write `payload`'s checksum into the encoded header `header` (uint8, on the payload's
    device), in place; on CUDA without a host sync."""
    field = header[CHECKSUM_OFFSET:CHECKSUM_OFFSET + 8]
    if payload.device.type == "cpu":
        value = compute(payload)
        field.copy_(torch.frombuffer(bytearray(value.to_bytes(8, "little")), dtype=torch.uint8))
    else:  # little-endian int64 bytes, as the header's unsigned field reads them
        field.copy_(hash_kernel.device_hash(payload).reshape(1).view(torch.uint8))
