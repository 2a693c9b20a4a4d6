"""The learned load map checked against vLLM's own loaders, bit for bit, before it is trusted.

During the learning refit (which loads through `load_weights`) each bucket's received bytes
are kept, and so is a fingerprint of what vLLM's per-layer processing was given (each layer's
model-format tensors as its quant method's `process_weights_after_loading` received them).
Once that refit's load is complete, the map re-applies the same bytes over the loaders'
result: every readable param must come out bit for bit as the loaders left it (prepacked
fused experts included), and every layer the map processes must have been processed again,
given the same bytes. That second half sees what a read cannot: the params vLLM's CPU kernels
empty (their values live inside a kernel handle), and a layer whose processing was skipped
(its old kernel would keep serving). A difference drops the map, and the kept bytes are
loaded once more through `load_weights`, so the engine ends on the loaders' result either way.
Costs, during the learning refit only: one copy of the received bytes on the worker's device,
one of the readable params and a checksum pass over the processed layers' tensors, twice.
Only vLLM processes import this module.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase
from vllm.model_executor.model_loader.reload.layerwise import (
    finalize_layerwise_reload,
    initialize_layerwise_reload,
)
from vllm.model_executor.model_loader.reload.utils import get_layer_tensors

from common.in_vllm.apply import PROCESS, DirectLoad, model_format
from common.in_vllm.load_map import byte_span
from common.packing import byte_view, unpack
from common.plan import RefitPlan
from common.wire import checksum

Fingerprint = dict[str, tuple[tuple[int, ...], torch.dtype, int]]  # name: shape, dtype, checksum


@dataclass
class MapCheck:
    compared: int  # readable params compared bit for bit
    unreadable: int  # params the map fills that no read can see (emptied by CPU kernels)
    processed: int  # layers whose processing input was compared with the loaders'
    differ: list[str]  # params (or layers' processing) that differ from the loaders'


class ProcessingWatch:
    """While open: for each layer whose quant method's `process_weights_after_loading` runs,
    the fingerprint of its loadable model-format tensors the first time (the reload's own
    processing; a later run, e.g. `ReloadFixes` redoing a tied layer, sees processed
    tensors), by layer path."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.seen: dict[str, Fingerprint] = {}
        self._methods: dict[int, QuantizeMethodBase] = {}  # a method may serve several layers
        paths = {m: p for p, m in model.named_modules()}
        for layer in model.modules():
            method = getattr(layer, "quant_method", None)
            if isinstance(method, QuantizeMethodBase) and id(method) not in self._methods:
                method.process_weights_after_loading = self._watched(
                    paths, method.process_weights_after_loading)
                self._methods[id(method)] = method

    def _watched(self, paths: dict, process: Callable) -> Callable:
        def process_weights_after_loading(layer: torch.nn.Module, *args, **kwargs):
            if (path := paths.get(layer)) is not None and path not in self.seen:
                self.seen[path] = _fingerprint(layer)
            return process(layer, *args, **kwargs)

        return process_weights_after_loading

    def kept_bytes(self, model: torch.nn.Module) -> frozenset[str]:
        """The layers seen since the last take whose processed (serving) tensors are the
        model-format tensors their processing was given: same names, shapes, dtypes, bytes."""
        modules = dict(model.named_modules())
        return frozenset(path for path, given in self.seen.items()
                         if given and _fingerprint(modules[path]) == given)

    def take(self) -> dict[str, Fingerprint]:
        """What was seen since the last take (the next run of a layer counts as its first)."""
        seen, self.seen = self.seen, {}
        return seen

    def close(self) -> None:
        """Unwrap the quant methods (safe to call twice)."""
        for method in self._methods.values():
            vars(method).pop("process_weights_after_loading", None)
        self._methods.clear()


class Kept:
    """What the map check keeps of the learning refit: each bucket's received bytes and what
    vLLM's processing was given (`ProcessingWatch`: `close` it when the refit ends)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.payloads: dict[int, torch.Tensor] = {}
        self.processing = ProcessingWatch(model)

    def keep(self, index: int, items: list[tuple[str, torch.Tensor]], nbytes: int) -> None:
        """A copy of received bucket `index`: `nbytes` from its first tensor's first byte."""
        self.payloads[index] = byte_span(items[0][1], nbytes).clone()

    def close(self) -> None:
        self.processing.close()


def check_map(direct: DirectLoad, model: torch.nn.Module, kept: Kept,
              redo: Callable[[set[str]], None]) -> MapCheck:
    """Re-apply the kept buckets through `direct` over the loaders' result and compare."""
    before = readable_params(model)
    loaders = kept.processing.take()
    direct.begin(direct_only=True)
    loaded: set[str] = set()
    for index, payload in kept.payloads.items():
        loaded |= direct.load(index, [("", payload)], None)
    redo(loaded)
    layers = sorted(p for p, kind in direct.kinds.items() if kind == PROCESS and p in loaders)
    differ = changed_params(model, before) + _processing_differs(layers, loaders,
                                                                 kept.processing.take())
    return MapCheck(len(before), len(loaded - before.keys()), len(layers), differ)


def _processing_differs(layers: list[str], loaders: dict[str, Fingerprint],
                        direct: dict[str, Fingerprint]) -> list[str]:
    """The layers (or their tensors) whose processing the re-apply skipped or fed other
    bytes than the loaders did."""
    differ = []
    for path in layers:
        if path not in direct:
            differ.append(f"{path} (its processing did not run)")
            continue
        differ += [f"{path}.{name} (as its processing got it)"
                   for name in sorted(loaders[path].keys() | direct[path].keys())
                   if loaders[path].get(name) != direct[path].get(name)]
    return differ


def _fingerprint(layer: torch.nn.Module) -> Fingerprint:
    """Shape, dtype and checksum of each loadable model-format tensor the layer holds."""
    names = model_format(layer)
    return {name: (tuple(t.shape), t.dtype, _checksum(t))
            for name, t in get_layer_tensors(layer).items() if name in names and not t.is_meta}


def _checksum(tensor: torch.Tensor) -> int:
    raw = byte_view(tensor.detach().contiguous())
    return checksum.compute(raw if checksum.supported(raw.device) else raw.cpu())


def readable_params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Copies of the params a read can see (CPU kernels empty some: those are left out)."""
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.numel()}


def changed_params(model: torch.nn.Module, before: dict[str, torch.Tensor]) -> list[str]:
    """The params of `before` whose bytes (or shape, dtype) are not what they were."""
    now = dict(model.named_parameters())
    return [n for n, was in before.items() if n not in now or not _same_bits(now[n].detach(), was)]


def reload_kept(model: torch.nn.Module, plan: RefitPlan, kept: Kept,
                model_config: object, redo: Callable[[set[str]], None]) -> None:
    """Load the kept buckets through `load_weights` again (after a failed check)."""
    initialize_layerwise_reload(model)
    loaded: set[str] = set()
    for index, payload in kept.payloads.items():
        bucket = plan.buckets[index]
        loaded |= model.load_weights(unpack(payload, plan.bucket_specs(bucket), bucket.offsets))
    finalize_layerwise_reload(model, model_config)
    redo(loaded)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return torch.equal(a.contiguous().reshape(-1).view(torch.uint8),
                       b.contiguous().reshape(-1).view(torch.uint8))
