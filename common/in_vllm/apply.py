"""Direct apply: a refit's bytes copied where vLLM's loaders would put them, one memcpy loop.

The first refit of a worker loads through `load_weights` under a `CopyRecorder`; from it
`map_learn.learn` builds a `DirectLoad`, which keeps, per bucket, the byte runs into each
layer's model-format tensors. A layer that serves its tensors as loaded gets its runs straight
into the serving tensors: norms, and on a GPU the unquantized linears, embeddings and fused-MoE
experts whose processing the learning refit saw leave the loaded bytes as they were
(`KEEPS_LOADED_BYTES`). A layer with real post-load processing (CPU prepacked linears and
embeddings, shuffled experts) gets them into fresh model-format tensors, then vLLM's own
per-layer reload step processes it once.
Tensors the map cannot express keep `load_weights`. Only vLLM processes import this module.
"""

from __future__ import annotations

import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase
from vllm.model_executor.model_loader.reload.layerwise import (
    LAYERWISE_INFO,
    _layerwise_process,
    _place_kernel_tensors,
    get_layerwise_info,
    initialize_layerwise_reload,
)
from vllm.model_executor.model_loader.reload.meta import materialize_layer
from vllm.model_executor.model_loader.reload.utils import get_layer_tensors

from common.in_vllm.compat import (
    SKIP_LOAD_TENSORS,
    is_deferred_attention_layer,
)
from common.in_vllm.load_map import BucketCopy, Dest
from common.in_vllm.loaded_hash import LoadedHashes
from common.plan import RefitPlan
from common.shard.needs import ByteRanges, Needs

COPY, PROCESS = "copy", "process"  # straight into the serving tensors / through processing
# Quant methods whose processing, off the CPU, derives nothing from the loaded values beyond the
# layer's own tensors (no packed copy, no kernel handle, no scales): where the learning refit saw
# it leave a layer's bytes as loaded, re-running it would only copy them onto themselves. On
# the CPU the same methods keep prepacked copies of the weights: never skipped there.
KEEPS_LOADED_BYTES = frozenset({"UnquantizedLinearMethod", "UnquantizedEmbeddingMethod",
                                "UnquantizedFusedMoEMethod"})
Items = list[tuple[str, torch.Tensor]]


@dataclass
class BucketRuns:
    """One bucket's share: byte runs from its tensors into destinations, and the layers."""

    copy: BucketCopy  # destinations index `DirectLoad.dests`
    fallback: list[int] = field(default_factory=list)  # positions left to `load_weights`
    loaded: set[str] = field(default_factory=set)  # param names it fills
    layers: list[str] = field(default_factory=list)  # processed layers it writes into


def model_format(layer: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The layer's loadable model-format tensors (meta) as vLLM recorded them at startup."""
    params, buffers = get_layerwise_info(layer).restore_metadata
    return {n: t for n, t in {**params, **buffers}.items() if n not in SKIP_LOAD_TENSORS}


def layer_kind(layer: torch.nn.Module, kept_bytes: bool = False) -> str | None:
    """COPY, PROCESS, or None: the layer keeps `load_weights` (attention layers, processed
    at the end of the reload). `kept_bytes`: its processing was seen to leave the loaded
    bytes as they were (`map_check.ProcessingWatch.kept_bytes`)."""
    if is_deferred_attention_layer(layer):
        return None
    live = get_layer_tensors(layer)
    method = getattr(layer, "quant_method", None)
    if isinstance(method, QuantizeMethodBase) and not (
            kept_bytes and type(method).__name__ in KEEPS_LOADED_BYTES
            and all(t.device.type not in ("cpu", "meta") for t in live.values())):
        return PROCESS
    for name, meta in model_format(layer).items():
        t = live.get(name)
        if t is None or (t.shape, t.stride(), t.dtype) != (meta.shape, meta.stride(), meta.dtype):
            return PROCESS
    return COPY


def _in_serving_memory(layer: torch.nn.Module, info: object) -> None:
    """Give the layer's model-format params that match their serving tensor (shape, strides,
    dtype) that tensor's memory: the runs land there, and vLLM's copy of the processed
    tensors into the serving ones becomes a no-op (a copy onto the same memory), where a
    fresh tensor would cost an allocation, its page faults and that copy. The rest stay meta
    for `materialize_layer`."""
    serving = info.kernel_tensors[0]
    for name, meta in list(layer._parameters.items()):
        live = serving.get(name)
        if (meta is None or not meta.is_meta or live is None or not live.is_contiguous()
                or (live.shape, live.stride(), live.dtype) != (meta.shape, meta.stride(),
                                                               meta.dtype)):
            continue
        tensor = live.data
        tensor.__class__ = meta.__class__
        tensor.__dict__ = meta.__dict__.copy()
        setattr(layer, name, tensor)


class DirectLoad:
    """One worker's learned map (`learn`) and its use on each later refit (`begin`, `load`)."""

    def __init__(self, model: torch.nn.Module, dests: list[Dest], kinds: dict[str, str],
                 runs: dict[int, BucketRuns], report: dict,
                 consts: dict[str, list[tuple[int, np.ndarray, int, Any]]],
                 fallback_layers: frozenset[str] | None = None) -> None:
        """`consts`: per layer, the loaders' one-value fills (dest index, byte offsets, run,
        value): rewritten each refit, where no received byte lands (padding rows).
        `fallback_layers`: the layers the `load_weights` fallback loads into; None when some
        fallback tensor's layer is not known."""
        self.model, self.dests, self.kinds, self.runs = model, dests, kinds, runs
        self.consts = consts
        self.report = report
        self.plan_digest = report["plan_digest"]
        self.modules = dict(model.named_modules())
        self.paths = {m: p for p, m in self.modules.items()}
        self.reloaded = torch.nn.ModuleList(
            [self.modules[p] for p in self._reopened(fallback_layers)])
        self.processed = torch.nn.ModuleList(
            [self.modules[p] for p, k in kinds.items() if k == PROCESS])
        report["reopened"] = dict(Counter(type(m).__name__ for m in self.reloaded))
        self.bases = np.zeros(len(dests), dtype=np.int64)
        self.dest_index: dict[str, list[int]] = defaultdict(list)
        for i, dest in enumerate(dests):
            self.dest_index[dest.layer].append(i)
        self.shapes = self._live_shapes()
        self.need: Needs | None = None  # what it reads of each bucket (`use_compact`)
        # bucket -> its runs from a compact payload, and its fallback tensors' offsets there
        self.compact: dict[int, tuple[BucketCopy, list[tuple[int, int]]]] = {}
        self.hashes: LoadedHashes | None = None  # set by the caller for one refit
        # Each processed layer's buckets: a refit materialises the layer at the first of them
        # to arrive and processes it once the last has been applied, in any order (frames
        # of several sources arrive as they come, `common.transfer.streams`).
        self.spans = Counter(path for r in runs.values() for path in r.layers)
        self._left: dict[str, int] = {}

    def _reopened(self, fallback: frozenset[str] | None) -> list[str]:
        """What vLLM's reload must open each refit: the layers processed after their runs, the
        ones the fallback loads into, and the attention layers holding one of those (their
        processing at the end of the reload derives from them, e.g. MLA's from its
        kv_b_proj). An attention layer nothing loads into keeps what it holds (reopened it
        would only redo its processing: its scales refilled, a device sync each). Where a
        fallback tensor's layer is unknown: every layer with loadable tensors but the copy
        ones, every attention layer holding any."""
        kinds, modules = self.kinds, self.modules
        if fallback is None:
            return [p for p, m in modules.items()
                    if (is_deferred_attention_layer(m) and any(map(model_format, m.modules())))
                    or (model_format(m) and kinds.get(p) != COPY)]
        loaded = {p for p, k in kinds.items() if k == PROCESS} | fallback
        written = loaded | set(kinds)
        # by module, not by path: MLA's kv_b_proj is also registered under its attention
        return [p for p, m in modules.items() if p in loaded or (
            is_deferred_attention_layer(m)
            and any(self.paths.get(sub) in written for sub in m.modules()))]

    def _live_shapes(self) -> dict[int, tuple]:
        """Each copy layer's dests' serving tensors' (shape, strides, dtype), by dest index."""
        return {i: (t.shape, t.stride(), t.dtype) for i, t in self._copy_dests()}

    def _copy_dests(self) -> Iterator[tuple[int, torch.Tensor | None]]:
        """(dest index, its serving tensor now, or None) of every copy layer's dests: each
        layer's tensors looked up once (a lookup builds a dict of the layer's tensors)."""
        for path, idx in self.dest_index.items():
            if self.kinds.get(path) == COPY:
                live = get_layer_tensors(self.modules[path])
                for i in idx:
                    yield i, live.get(self.dests[i].name)

    def needs(self, plan: RefitPlan) -> Needs:
        """The bytes of each bucket this worker reads (`common.shard.needs`): its runs' sources and
        the whole tensors its loaders take (`load_weights`)."""
        out = {}
        for index, runs in self.runs.items():
            bucket = plan.buckets[index]
            starts = [bucket.offsets[p] - bucket.offsets[0] for p in runs.fallback]
            sizes = [plan.specs[bucket.spec_indices[p]].nbytes for p in runs.fallback]
            ranges = ByteRanges.of(np.concatenate([runs.copy.src, np.array(starts, np.int64)]),
                                   np.concatenate([runs.copy.nbytes, np.array(sizes, np.int64)]))
            if ranges.nbytes:
                out[index] = ranges
        return Needs(out)

    def use_compact(self, plan: RefitPlan) -> Needs:
        """This worker's needs, and its runs re-based onto compact payloads of them (so a
        compact frame applies like a whole bucket)."""
        self.need, self.compact = self.needs(plan), {}
        for index, ranges in self.need.buckets.items():
            runs, bucket = self.runs[index], plan.buckets[index]
            c = runs.copy
            rel = np.array([bucket.offsets[p] for p in runs.fallback], dtype=np.int64)
            sizes = np.array([plan.specs[bucket.spec_indices[p]].nbytes for p in runs.fallback],
                             dtype=np.int64)
            at = ranges.compact(rel, sizes) if len(rel) else rel
            self.compact[index] = (BucketCopy(ranges.compact(c.src, c.nbytes), c.dest, c.dst,
                                              c.nbytes),
                                   list(zip(runs.fallback, at.tolist(), strict=True)))
        return self.need

    def stale(self) -> str | None:
        """Why the map no longer fits the serving tensors (then a refit relearns it)."""
        for i, t in self._copy_dests():
            if t is None or (t.shape, t.stride(), t.dtype) != self.shapes[i]:
                return (f"{self.dests[i].param_name} changed shape or dtype since the map was "
                        f"learned")
        return None

    def begin(self, direct_only: bool = False) -> torch.nn.Module:
        """Open vLLM's reload for the layers that need it (not the copy ones: they keep the
        serving tensors the runs write into, resolved by name now: a refit may replace them);
        `direct_only`: for the processed layers of the map alone (a re-apply, see `verify`).
        Returns what was opened: the module to finalise the reload on."""
        t0 = time.perf_counter()
        self.times = {"copy_s": 0.0, "process_s": 0.0}  # this refit's, for the apply report
        self._left = dict(self.spans)
        opened = self.processed if direct_only else self.reloaded
        initialize_layerwise_reload(opened)
        for layer in opened.modules():
            if self.kinds.get(self.paths.get(layer)) == COPY:  # a copy layer inside another
                _place_kernel_tensors(layer, LAYERWISE_INFO[layer])
                LAYERWISE_INFO[layer].reset()
        for i, t in self._copy_dests():
            self.bases[i] = t.data_ptr()
        for path in self.consts:
            if self.kinds[path] == COPY:
                self._fill_consts(path)
        self.times["begin_s"] = time.perf_counter() - t0
        return opened

    def load(self, index: int, items: Items,
             fallback: Callable[[Items], set[str]] | None) -> set[str]:
        """Apply bucket `index`; its other tensors go to `fallback` (`load_weights`), or
        nowhere if None (`items` may then be the bucket's bytes alone)."""
        runs = self.runs[index]
        rest = [items[i] for i in runs.fallback] if fallback is not None else []
        return self._apply(index, runs.copy, items[0][1], rest, fallback)

    def load_compact(self, index: int, payload: torch.Tensor, plan: RefitPlan,
                     fallback: Callable[[Items], set[str]]) -> set[str]:
        """Apply bucket `index` from a compact frame's payload (`use_compact`)."""
        copy, places = self.compact[index]
        bucket, rest = plan.buckets[index], []
        for pos, at in places:
            spec = plan.specs[bucket.spec_indices[pos]]
            raw = payload[at : at + spec.nbytes]
            if raw.data_ptr() % spec.dtype.itemsize:
                raw = raw.clone()  # placed after a range of another dtype: align it
            rest.append((spec.name, raw.view(spec.dtype).view(spec.shape)))
        return self._apply(index, copy, payload, rest, fallback)

    def _apply(self, index: int, copy: BucketCopy, first: torch.Tensor, rest: Items,
               fallback: Callable[[Items], set[str]] | None) -> set[str]:
        """Bucket `index`'s runs from the bytes at `first`, then vLLM's processing of the
        layers it completes; `rest` to `fallback`."""
        runs = self.runs[index]
        for path in runs.layers:
            if self._left[path] == self.spans[path]:  # the first of its buckets to arrive
                layer = self.modules[path]
                _in_serving_memory(layer, LAYERWISE_INFO[layer])
                materialize_layer(layer, LAYERWISE_INFO[layer])
                live = get_layer_tensors(layer)
                for i in self.dest_index[path]:
                    self.bases[i] = live[self.dests[i].name].data_ptr()
                self._fill_consts(path)
        t0 = time.perf_counter()
        copy.run(first, self.bases)
        t1 = time.perf_counter()
        for path in runs.layers:
            self._left[path] -= 1
            if self._left[path] == 0:  # the last of its buckets: the layer is complete
                self._hash_layer(path)
                _layerwise_process(self.modules[path], LAYERWISE_INFO[self.modules[path]])
        self.times["copy_s"] += t1 - t0
        self.times["process_s"] += time.perf_counter() - t1
        loaded = set(runs.loaded)
        if rest and fallback is not None:
            if self.hashes is not None:
                for name, tensor in rest:
                    self.hashes.add(name, tensor)
            loaded |= fallback(rest)
        return loaded

    def _fill_consts(self, path: str) -> None:
        """The loaders' one-value fills of layer `path`, written again."""
        live = get_layer_tensors(self.modules[path])
        for i, offsets, nbytes, value in self.consts.get(path, ()):
            t = live[self.dests[i].name].detach()
            flat = t.as_strided((int(offsets.max() + nbytes) // t.itemsize,), (1,))
            for at in (offsets // t.itemsize).tolist():
                flat[at : at + nbytes // t.itemsize].fill_(value)

    def _hash_layer(self, path: str) -> None:
        """Its dests' model-format bytes into `hashes` (when on)."""
        if self.hashes is not None:
            live = get_layer_tensors(self.modules[path])
            for i in self.dest_index[path]:
                self.hashes.add(self.dests[i].param_name, live[self.dests[i].name])

    def hash_copy_layers(self) -> None:
        """At the end of a refit: the copy layers' serving tensors (model format) into
        `hashes` (when on)."""
        for path, kind in self.kinds.items():
            if kind == COPY and path in self.dest_index:
                self._hash_layer(path)
