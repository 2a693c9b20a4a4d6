"""Hashes of the model-format bytes a worker loaded in a refit, for comparing two workers.

On CPU vLLM empties its linear weights after prepacking, so reading params after a refit sees
only norms and embeddings. These hashes are taken where the bytes are still in model format:
a processed layer's tensors just before vLLM's post-load processing, a copy layer's serving
tensors at the end of the refit, and what went to `load_weights` as it was handed over. Two
workers of the same layout that loaded the same bytes have equal digests whatever path the
bytes took (whole buckets or compact frames). Switched on by REFIT_HASH_LOADED=1 (it reads
every loaded byte once more).
"""

from __future__ import annotations

import hashlib
import os

import torch

from common.packing import byte_view
from common.wire import checksum


def enabled() -> bool:
    return os.environ.get("REFIT_HASH_LOADED", "0") == "1"


class LoadedHashes:
    """Tensor name -> CRC-32 of its model-format bytes, for one refit."""

    def __init__(self) -> None:
        self.crcs: dict[str, int] = {}

    def add(self, name: str, tensor: torch.Tensor) -> None:
        data = byte_view(tensor.detach().contiguous())
        self.crcs[name] = checksum.compute(data.cpu() if data.is_cuda else data)

    def digest(self) -> str:
        text = "\n".join(f"{k} {v:08x}" for k, v in sorted(self.crcs.items()))
        return hashlib.sha256(text.encode()).hexdigest()
