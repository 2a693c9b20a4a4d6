"""The bucket header: the first HEADER_BYTES of every bucket on the wire.

It carries the bucket index, the weight version and the plan digest (so a desynchronised rank
is caught, never silently loaded), an OK / ABORT status with the sender's reason, so an abort
reaches every rank inside the same collective that would have carried the bucket, and the
payload's checksum where the sender computed one (`common.wire.checksum`).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import torch

HEADER_BYTES = 512
MAGIC = 0x52454649  # "REFI"
STATUS_OK, STATUS_ABORT = 1, 2
# magic, status, bucket, num_buckets, version, msg_len, plan digest, has checksum, checksum
_FIXED = struct.Struct("<qqqqqq32sqQ")
CHECKSUM_OFFSET = _FIXED.size - 8
MAX_MESSAGE = HEADER_BYTES - _FIXED.size


@dataclass(frozen=True)
class Header:
    bucket: int
    num_buckets: int
    version: int
    digest: str
    status: int = STATUS_OK
    message: str = ""
    checksummed: bool = False  # the sender stamps the checksum after packing (`stamp`)
    checksum: int = 0

    def encode_bytes(self) -> bytes:
        msg = self.message.encode()[:MAX_MESSAGE]
        fixed = _FIXED.pack(MAGIC, self.status, self.bucket, self.num_buckets, self.version,
                            len(msg), bytes.fromhex(self.digest), int(self.checksummed),
                            self.checksum)
        return (fixed + msg).ljust(HEADER_BYTES, b"\0")

    def encode(self) -> torch.Tensor:
        return torch.frombuffer(bytearray(self.encode_bytes()), dtype=torch.uint8)

    @classmethod
    def decode(cls, data: torch.Tensor) -> Header:
        raw = data[:HEADER_BYTES].cpu().numpy().tobytes()
        (magic, status, bucket, num_buckets, version, msg_len, digest, checksummed,
         checksum) = _FIXED.unpack_from(raw)
        if magic != MAGIC or status not in (STATUS_OK, STATUS_ABORT):
            raise ValueError(f"not a refit bucket header (magic {magic:#x}, status {status})")
        message = raw[_FIXED.size : _FIXED.size + msg_len].decode(errors="replace")
        return cls(bucket, num_buckets, version, digest.hex(), status, message,
                   bool(checksummed), checksum)

    def mismatch(self, expected: Header) -> str | None:
        """Why this received header is not the one expected, or None."""
        for key in ("bucket", "num_buckets", "version", "digest"):
            got, want = getattr(self, key), getattr(expected, key)
            if got != want:
                return f"header {key} is {got}, expected {want}"
        return None
