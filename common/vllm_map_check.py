"""The learned load map checked against vLLM's own loaders, bit for bit, before it is trusted.

During the learning refit (which loads through `load_weights`) each bucket's received bytes
are kept; once that refit's load is complete, the map re-applies the same bytes over the
loaders' result and every readable param must come out bit for bit as the loaders left it
(prepacked fused experts included). A difference drops the map, and the kept bytes are
loaded once more through `load_weights`, so the engine ends on the loaders' result either way.
Params vLLM's CPU kernels empty (their values live inside a kernel handle) cannot be read:
they are counted. Costs, during the learning refit only: one copy of the received bytes on
the worker's device and one of the readable params. Only vLLM processes import this module.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from vllm.model_executor.model_loader.reload.layerwise import (
    finalize_layerwise_reload,
    initialize_layerwise_reload,
)

from common.load_map import byte_span
from common.packing import unpack
from common.plan import RefitPlan
from common.vllm_apply import DirectLoad


@dataclass
class MapCheck:
    compared: int  # readable params compared bit for bit
    unreadable: int  # params the map fills that no read can see (emptied by CPU kernels)
    differ: list[str]  # params whose re-applied value differs from the loaders'


def keep_payload(items: list[tuple[str, torch.Tensor]], nbytes: int) -> torch.Tensor:
    """A copy of one received bucket: `nbytes` from its first tensor's first byte."""
    return byte_span(items[0][1], nbytes).clone()


def check_map(direct: DirectLoad, model: torch.nn.Module, kept: dict[int, torch.Tensor],
              redo: Callable[[set[str]], None]) -> MapCheck:
    """Re-apply the kept buckets through `direct` over the loaders' result and compare."""
    before = readable_params(model)
    direct.begin(direct_only=True)
    loaded: set[str] = set()
    for index, payload in kept.items():
        loaded |= direct.load(index, [("", payload)], None)
    redo(loaded)
    return MapCheck(len(before), len(loaded - before.keys()), changed_params(model, before))


def readable_params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Copies of the params a read can see (CPU kernels empty some: those are left out)."""
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.numel()}


def changed_params(model: torch.nn.Module, before: dict[str, torch.Tensor]) -> list[str]:
    """The params of `before` whose bytes (or shape, dtype) are not what they were."""
    now = dict(model.named_parameters())
    return [n for n, was in before.items() if n not in now or not _same_bits(now[n].detach(), was)]


def reload_kept(model: torch.nn.Module, plan: RefitPlan, kept: dict[int, torch.Tensor],
                model_config: object, redo: Callable[[set[str]], None]) -> None:
    """Load the kept buckets through `load_weights` again (after a failed check)."""
    initialize_layerwise_reload(model)
    loaded: set[str] = set()
    for index, payload in kept.items():
        bucket = plan.buckets[index]
        loaded |= model.load_weights(unpack(payload, plan.bucket_specs(bucket), bucket.offsets))
    finalize_layerwise_reload(model, model_config)
    redo(loaded)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return torch.equal(a.contiguous().reshape(-1).view(torch.uint8),
                       b.contiguous().reshape(-1).view(torch.uint8))
