"""Learning the load map: from the copies one `load_weights` refit made (`CopyRecorder`) to a
`DirectLoad`: which layers take runs straight into their serving tensors, which through
vLLM's processing, which stay on `load_weights` and why. Only vLLM processes import this.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from typing import Any

import numpy as np
import torch
from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info

from common.in_vllm.apply import COPY, PROCESS, BucketRuns, DirectLoad, layer_kind, model_format
from common.in_vllm.compat import get_tensor_load_numel
from common.in_vllm.load_map import BucketCopy, CopyRecorder, Dest, Fill, byte_runs, tiles_exactly
from common.plan import RefitPlan


def learn(model: torch.nn.Module, plan: RefitPlan, recorder: CopyRecorder,
          kept_bytes: frozenset[str] = frozenset()) -> DirectLoad:
    """The map from one recorded `load_weights` refit (see the module docstring);
    `kept_bytes`: the layers whose processing left their loaded bytes as they were."""
    modules = dict(model.named_modules())
    layers = {p: m for p, m in modules.items() if model_format(m)}
    bad_tensors, ran = _runs_of_fills(recorder)
    bad_layers = {d.layer: f"{d.name} {why}" for d, why in recorder.bad_dests.items()}
    consts = _const_runs(recorder, bad_layers)
    fed: dict[str, set[int]] = defaultdict(set)
    for fill in recorder.fills:
        fed[fill.dest.layer].add(fill.index)
    kinds = {}
    for path in fed:
        kinds[path] = layer_kind(layers[path], path in kept_bytes)
        if kinds[path] is None:
            bad_layers.setdefault(path, "is processed at the end of the reload")
        why = _untiled(path, layers[path], ran, consts.get(path, []))
        if why:
            bad_layers.setdefault(path, why)
    _spread(plan, bad_tensors, bad_layers, fed)
    for path in layers.keys() - fed.keys():  # loads nothing: its serving tensors stay
        if layer_kind(layers[path]) is not None:
            kinds[path] = COPY
    kinds = {p: k for p, k in kinds.items() if p not in bad_layers}
    dests = sorted({f.dest for f in [*recorder.fills, *recorder.const_fills]
                    if f.dest.layer in kinds}, key=lambda d: (d.layer, d.name))
    dest_ids = {d: i for i, d in enumerate(dests)}
    params = {p: set(get_layerwise_info(m).restore_metadata[0]) for p, m in layers.items()}
    runs = _bucket_runs(plan, bad_tensors, ran, dest_ids, kinds, params)
    report = _report(plan, bad_tensors, ran)
    report["layers"] = dict(Counter(kinds.values()))
    fills = {p: [(dest_ids[d], dst, n, value) for d, dst, n, value in c]
             for p, c in consts.items() if p in kinds}
    fed_tensors = set().union(*fed.values())
    fallback_layers = None if bad_tensors.keys() - fed_tensors else frozenset(bad_layers)
    direct = DirectLoad(model, dests, kinds, runs, report, fills, fallback_layers)
    needs = direct.use_compact(plan)
    report.update(needs_bytes=needs.nbytes(), needs_digest=needs.digest[:16])
    return direct


RunList = list[tuple[Fill, tuple[np.ndarray, np.ndarray, int]]]


def _runs_of_fills(recorder: CopyRecorder) -> tuple[dict[int, str], dict[int, RunList]]:
    """Byte runs of every recorded fill, by tensor; the tensors no memcpy can load, and why."""
    bad = dict(recorder.bad_tensors)
    ran: dict[int, RunList] = defaultdict(list)
    for fill in recorder.fills:
        runs = byte_runs(fill)
        if runs is None:
            bad.setdefault(fill.index, f"copied element by element into {fill.dest.param_name}")
        else:
            ran[fill.index].append((fill, runs))
    return bad, ran


ConstRuns = list[tuple[Dest, np.ndarray, int, Any]]  # (dest, its byte offsets, run, value)


def _const_runs(recorder: CopyRecorder, bad_layers: dict[str, str]) -> dict[str, ConstRuns]:
    """Each layer's one-value fills as byte runs; a fill too fine for runs makes it bad."""
    out: dict[str, ConstRuns] = defaultdict(list)
    for fill in recorder.const_fills:
        runs = byte_runs(fill)
        if runs is None:
            bad_layers.setdefault(fill.dest.layer, f"{fill.dest.name} filled element by element")
        else:
            out[fill.dest.layer].append((fill.dest, runs[1], runs[2], fill.value))
    return out


def _untiled(path: str, layer: torch.nn.Module, ran: dict[int, RunList],
             consts: ConstRuns) -> str | None:
    """Why the recorded runs (received bytes, and the loaders' one-value fills) do not fill
    each of the layer's loadable tensors exactly once."""
    by_name: dict[str, list] = defaultdict(list)
    for runs in ran.values():
        for fill, (_, dst, n) in runs:
            if fill.dest.layer == path:
                by_name[fill.dest.name].append((dst, np.full(len(dst), n, dtype=np.int64)))
    for dest, dst, n, _ in consts:
        by_name[dest.name].append((dst, np.full(len(dst), n, dtype=np.int64)))
    for name, meta in model_format(layer).items():
        loadable = get_tensor_load_numel(meta) * meta.element_size()
        parts = by_name.get(name)
        if not parts:
            if loadable:
                return f"{name} was not loaded by plain copies"
            continue
        dst, n = np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])
        if not tiles_exactly(dst, n, loadable):
            return f"{name}: the copies do not cover its {loadable} bytes exactly once"
    return None


def _spread(plan: RefitPlan, bad_tensors: dict[int, str], bad_layers: dict[str, str],
            fed: dict[str, set[int]]) -> None:
    """A layer loads wholly one way: a bad tensor makes its layers bad, and back."""
    layers_of: dict[int, set[str]] = defaultdict(set)
    for path, tensors in fed.items():
        for t in tensors:
            layers_of[t].add(path)
    changed = True
    while changed:
        changed = False
        for t, why in list(bad_tensors.items()):
            for path in layers_of[t] - bad_layers.keys():
                bad_layers[path] = f"also takes {plan.specs[t].name!r} ({why})"
                changed = True
        for path, why in list(bad_layers.items()):
            for t in fed.get(path, set()) - bad_tensors.keys():
                bad_tensors[t] = f"{path} {why}"
                changed = True


def _bucket_runs(plan: RefitPlan, bad_tensors: dict[int, str], ran: dict[int, RunList],
                 dest_ids: dict[Dest, int], kinds: dict[str, str],
                 params_of: dict[str, set[str]]) -> dict[int, BucketRuns]:
    """Each bucket's runs (offsets from its first tensor), fallback positions and layers."""
    out = {}
    for bucket in plan.buckets:
        parts, br = [], BucketRuns(BucketCopy(*(np.zeros(0, dtype=np.int64),) * 4))
        for pos, t in enumerate(bucket.spec_indices):
            rel = bucket.offsets[pos] - bucket.offsets[0]
            if t in bad_tensors or rel % plan.specs[t].dtype.itemsize:
                br.fallback.append(pos)
                continue
            for fill, (src, dst, n) in ran.get(t, []):
                parts.append((rel + src, np.full(len(src), dest_ids[fill.dest], dtype=np.int64),
                              dst, np.full(len(src), n, dtype=np.int64)))
                layer = fill.dest.layer
                if fill.dest.name in params_of[layer]:
                    br.loaded.add(fill.dest.param_name)
                if kinds[layer] == PROCESS and layer not in br.layers:
                    br.layers.append(layer)
        if parts:
            br.copy = BucketCopy(*(np.concatenate(c) for c in zip(*parts, strict=True)))
        out[bucket.index] = br
    return out


def _report(plan: RefitPlan, bad_tensors: dict[int, str], ran: dict[int, RunList]) -> dict:
    """Tensors and bytes per path, and the commonest reasons for the fallback."""
    direct = [i for i in range(len(plan.specs)) if i not in bad_tensors and ran.get(i)]
    fallback = list(bad_tensors)
    reasons = Counter(why.split(" (")[0] for why in bad_tensors.values())
    nbytes = lambda idx: sum(plan.specs[i].nbytes for i in idx)  # noqa: E731
    return {"plan_digest": plan.digest, "direct_tensors": len(direct),
            "direct_bytes": nbytes(direct),
            "fallback_tensors": len(fallback), "fallback_bytes": nbytes(fallback),
            "unloaded_tensors": len(plan.specs) - len(direct) - len(fallback),
            "total_bytes": plan.total_bytes, "fallback_reasons": dict(reasons.most_common(5))}
