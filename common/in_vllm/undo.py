"""What a worker's base and undo log need from its vLLM process: where the base lives, a hash
of it for the apply report, and the agreement of an engine's workers that all rolled back."""

from __future__ import annotations

import os

import torch
from vllm.distributed.parallel_state import get_world_group

from common.delta.store import FrameStore
from common.errors import ROLLED_BACK, RefitError
from common.in_vllm import loaded_hash


def base_place(device: torch.device) -> torch.device:
    """REFIT_BASE_PLACE: where this worker keeps its base (`RefitConfig.delta` / `undo_bytes`):
    "device" (default) or "host" (host memory: frees device memory, a copy per frame)."""
    place = os.environ.get("REFIT_BASE_PLACE", "device")
    if place not in ("device", "host"):
        raise ValueError(f"REFIT_BASE_PLACE={place!r}: use 'device' or 'host'")
    return device if place == "device" else torch.device("cpu")


def base_report(base: FrameStore) -> dict:
    """The base's memory and, with REFIT_HASH_LOADED=1, a hash of its bytes (the model-format
    bytes this worker holds)."""
    out: dict = {"base_bytes": base.nbytes()}
    if loaded_hash.enabled():
        hashes = loaded_hash.LoadedHashes()
        for index, entry in sorted(base.entries.items()):
            hashes.add(str(index), entry)
        out["base_hash"] = hashes.digest()
    return out


def engine_verdict(failure: Exception, why: str | None, version: int | None) -> RefitError:
    """The failed refit's error, saying whether every worker of this engine (vLLM's world
    group) rolled back to `version`; `why`: why this one could not (None: it did)."""
    group = get_world_group()
    agreed = why is None
    if group.world_size > 1:
        flag = torch.tensor([int(agreed)], dtype=torch.int32)
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MIN,
                                     group=group.cpu_group)
        agreed = bool(flag.item())
    if agreed:
        return RefitError(f"{failure}; {ROLLED_BACK} (v{version})")
    return RefitError(f"{failure}; not rolled back: "
                      f"{why or 'another worker of this engine could not roll back'}")
