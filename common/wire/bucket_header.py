"""The bucket header: the first HEADER_BYTES of every bucket on the wire.

It carries the bucket index, the weight version and the plan digest (so a desynchronised rank
is caught, never silently loaded), an OK / ABORT status with the sender's reason, so an abort
reaches every rank inside the same collective that would have carried the bucket (or a
NONFINITE status a device kernel wrote into the header while it filled the frame: an FP8
weight that is not finite, `common.quant.fp8_fill`), and the
payload's checksum where the sender computed one (`common.wire.checksum`). Frames of one bucket
differ by receiver (`common.shard.plan`): the header says which need-set a frame is for, its
kind (the whole bucket, or compact: only the set's ranges) and its payload's size, which each
receiver knows before it posts the frame (from the re-plan), and checks. A need-set in delta
mode (`common.delta.frames`) sends frames whose size only the sender knows once it has
encoded them: each frame's header then goes as a fixed-size broadcast of its own, followed by
the payload, whose receive each rank posts once the header has landed; a delta frame's header
also carries the checksum of the bytes it rebuilds.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import torch

HEADER_BYTES = 512
MAGIC = 0x52454649  # "REFI"
STATUS_OK, STATUS_ABORT, STATUS_NONFINITE = 1, 2, 3
STATUS_OFFSET = 8  # the status's bytes (<q after magic): a kernel may write it on the device
NONFINITE_MESSAGE = ("a weight of this bucket is not finite (NaN or inf), found as it was "
                     "quantized to FP8; the trainers' error names it")
# magic, status, bucket, num_buckets, version, msg_len, plan digest, need-set, frame kind,
# payload bytes, rebuilt bytes' checksum, has checksum, checksum
_FIXED = struct.Struct("<qqqqqq32sqqqQqQ")
CHECKSUM_OFFSET = _FIXED.size - 8
VERSION_SLICE = slice(32, 40)  # the version's bytes (<q after magic, status, bucket, count)
MAX_MESSAGE = HEADER_BYTES - _FIXED.size


@dataclass(frozen=True)
class Header:
    bucket: int
    num_buckets: int
    version: int
    digest: str
    status: int = STATUS_OK
    message: str = ""
    need_set: int = -1  # -1: the whole group (no need-sets)
    kind: int = 0  # `common.shard.plan.FULL` / `COMPACT`
    payload_bytes: int = 0
    rebuilt_checksum: int = 0  # a delta frame: the checksum of the bytes it rebuilds
    checksummed: bool = False  # the sender stamps the checksum after packing (`stamp`)
    checksum: int = 0

    def encode_bytes(self) -> bytes:
        msg = self.message.encode()[:MAX_MESSAGE]
        fixed = _FIXED.pack(MAGIC, self.status, self.bucket, self.num_buckets, self.version,
                            len(msg), bytes.fromhex(self.digest), self.need_set, self.kind,
                            self.payload_bytes, self.rebuilt_checksum, int(self.checksummed),
                            self.checksum)
        return (fixed + msg).ljust(HEADER_BYTES, b"\0")

    def encode(self) -> torch.Tensor:
        return torch.frombuffer(bytearray(self.encode_bytes()), dtype=torch.uint8)

    @classmethod
    def decode(cls, data: torch.Tensor) -> Header:
        raw = data[:HEADER_BYTES].cpu().numpy().tobytes()
        (magic, status, bucket, num_buckets, version, msg_len, digest, need_set, kind,
         payload_bytes, rebuilt, checksummed, checksum) = _FIXED.unpack_from(raw)
        if magic != MAGIC or status not in (STATUS_OK, STATUS_ABORT, STATUS_NONFINITE):
            raise ValueError(f"not a refit bucket header (magic {magic:#x}, status {status})")
        message = raw[_FIXED.size : _FIXED.size + msg_len].decode(errors="replace")
        if status == STATUS_NONFINITE:
            message = NONFINITE_MESSAGE
        return cls(bucket, num_buckets, version, digest.hex(), status, message, need_set,
                   kind, payload_bytes, rebuilt, bool(checksummed), checksum)

    def mismatch(self, expected: Header) -> str | None:
        """Why this received header is not the one expected, or None."""
        for key in ("bucket", "num_buckets", "version", "digest", "need_set", "kind",
                    "payload_bytes"):
            got, want = getattr(self, key), getattr(expected, key)
            if got != want:
                return f"header {key} is {got}, expected {want}"
        return None
