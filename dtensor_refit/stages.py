"""Pipeline stages: every rank's stage specs merged into one plan, with one metadata exchange.

A model split into stages (transformers' `apply_pipeline_parallelism`, torchtitan's module
split) leaves each rank only its own stage's tensors, while the refit plan must list the whole
model the same way on every rank. Each rank lists the specs of its model parts from metadata
(as the single-model source does), the lists travel once over the training group
(`all_gather_object`), and every rank merges them with the same pure function, so plan order,
source ranks and errors agree everywhere. A stage is identified by the ranks its DTensor meshes
span and the part's position in the rank's list (all ranks of a stage hold it at the same
position). Stages are ordered by (first rank, position); each tensor is sent by the first rank
of the first stage that holds it, so each stage feeds the refit group directly, as the Megatron
source does. A name held by two stages (tied embeddings kept on the last stage by transformers'
helper) must agree in shape, dtype and value at setup; it is then sent once.
"""

from __future__ import annotations

import hashlib
import logging
import re
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from common.plan import TensorSpec, dtype_from_name, dtype_name
from dtensor_refit.layout import LayoutError, model_entries
from dtensor_refit.names import hf_model

#: (name, shape, declared dtype name) of one checkpoint tensor, as exchanged between ranks.
Meta = tuple[str, tuple[int, ...], str]
StageKey = tuple[tuple[int, ...], int]  # (ranks of the stage, position in a rank's parts)
_LAYER = re.compile(r"\.layers\.(\d+)\.")
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Report:
    """What one rank tells the others at setup: its parts' specs, or why it could not list them.

    `sources` names the tensors not sent by their stage's first rank (experts sent by owners).
    """

    rank: int
    parts: tuple[tuple[StageKey, tuple[Meta, ...]], ...]
    error: str | None = None
    sources: tuple[tuple[str, int], ...] = ()


@dataclass(frozen=True)
class Merged:
    """The merged plan specs and, for names several stages hold, the stages holding them."""

    specs: tuple[TensorSpec, ...]
    owner: dict[str, StageKey]
    overlaps: dict[str, tuple[StageKey, ...]]


def part_ranks(part: torch.nn.Module, rank: int) -> tuple[int, ...]:
    """The default-group ranks a model part's DTensor meshes span (its stage), with `rank`."""
    ranks = {rank}
    meshes: dict[int, object] = {}
    for t in list(part.parameters()) + list(part.buffers()):
        if isinstance(t, DTensor) and id(t.device_mesh) not in meshes:
            meshes[id(t.device_mesh)] = t.device_mesh
            ranks.update(int(r) for r in t.device_mesh.mesh.flatten().tolist())
    return tuple(sorted(ranks))


def whole_model(part: torch.nn.Module, check: bool) -> dict[str, tuple[int, ...]] | None:
    """The whole model's checkpoint layout (rebuilt on meta from a part's transformers config)."""
    hf = hf_model(part)
    if hf is None:
        return None
    try:
        with torch.device("meta"):
            whole = type(hf)(hf.config)
    except Exception as e:  # noqa: BLE001 - then only layer gaps are checked
        log.warning("could not rebuild %s on meta (%s): stages checked for layer gaps only",
                    type(hf).__name__, e)
        return None
    return {n: s for e in model_entries(whole, check=check)
            for n, s in zip(e.names, e.shapes, strict=True)}


def describe(key: StageKey) -> str:
    ranks, part = key
    return f"the stage on ranks {list(ranks)} (part {part})"


def merge(reports: Sequence[Report]) -> Merged:
    """One deterministic plan from every rank's report; raises LayoutError naming the cause."""
    failed = [r for r in reports if r.error is not None]
    if failed:
        raise LayoutError("; ".join(f"rank {r.rank}: {r.error}" for r in failed))
    stages: dict[StageKey, tuple[int, tuple[Meta, ...]]] = {}
    for report in reports:
        for key, metas in report.parts:
            seen = stages.setdefault(key, (report.rank, metas))
            if seen[1] != metas:
                diff = sorted(set(seen[1]) ^ set(metas))[:3]
                raise LayoutError(f"ranks {seen[0]} and {report.rank} of {describe(key)} list "
                                  f"different tensors (first differences: {diff})")
    sources: dict[str, int] = {}
    for report in reports:
        for name, src in report.sources:
            if sources.setdefault(name, src) != src:
                raise LayoutError(f"ranks disagree on the source rank of {name!r}: "
                                  f"{sources[name]} and {src}")
    owner: dict[str, StageKey] = {}
    first: dict[str, Meta] = {}
    holders: dict[str, list[StageKey]] = {}
    specs: list[TensorSpec] = []
    for key in sorted(stages, key=lambda k: (k[0][0], k[1], k[0])):
        for meta in stages[key][1]:
            name = meta[0]
            holders.setdefault(name, []).append(key)
            if name not in owner:
                owner[name], first[name] = key, meta
                specs.append(TensorSpec(name, meta[1], dtype_from_name(meta[2]),
                                        sources.get(name, key[0][0])))
            elif first[name] != meta:
                raise LayoutError(
                    f"tensor {name!r} is in {describe(owner[name])} as {list(first[name][1])} "
                    f"{first[name][2]} and in {describe(key)} as {list(meta[1])} {meta[2]}: "
                    f"stages overlap")
    overlaps = {n: tuple(h) for n, h in holders.items() if len(h) > 1}
    return Merged(tuple(specs), owner, overlaps)


def check_complete(specs: Sequence[TensorSpec], expected: dict[str, tuple[int, ...]] | None
                   ) -> None:
    """Every tensor the whole model has is in some stage (and nothing else is).

    `expected` is the whole model's checkpoint layout when it is known (a transformers model,
    rebuilt on the meta device); otherwise only gaps in the layer numbering are found.
    """
    names = {s.name: s.shape for s in specs}
    if expected is None:
        layers = {int(m[1]) for n in names if (m := _LAYER.search(n))}
        gaps = sorted(set(range(max(layers) + 1)) - layers) if layers else []
        if gaps:
            raise LayoutError(f"layer {gaps[0]} (tensors '*.layers.{gaps[0]}.*') is missing "
                              f"from every pipeline stage (missing layers: {gaps[:8]})")
        return
    missing = [n for n in expected if n not in names]
    if missing:
        raise LayoutError(f"tensor {missing[0]!r} is missing from every pipeline stage "
                          f"({len(missing)} missing: {missing[:5]})")
    extra = [n for n in names if n not in expected]
    if extra:
        raise LayoutError(f"tensor {extra[0]!r} of a pipeline stage is not in the whole model "
                          f"({len(extra)} such: {extra[:5]})")
    wrong = [n for n in names if names[n] != expected[n]]
    if wrong:
        raise LayoutError(f"tensor {wrong[0]!r} has shape {list(names[wrong[0]])} in its stage "
                          f"but {list(expected[wrong[0]])} in the whole model")


def exchange(report: Report, group: dist.ProcessGroup | None, timeout_s: float) -> list[Report]:
    """Every rank's report, in rank order (one all_gather_object over the training group).

    On gloo a monitored barrier first names any rank that does not arrive within timeout_s;
    other backends wait for as long as the group's own timeout.
    """
    from datetime import timedelta

    if dist.get_backend(group) == "gloo":
        dist.monitored_barrier(group=group, timeout=timedelta(seconds=timeout_s),
                               wait_all_ranks=True)
    out: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, report, group=group)
    return out


def digest(tensor: torch.Tensor) -> str:
    """A value fingerprint of a full tensor (dtype, shape and bytes)."""
    t = tensor.detach().contiguous().cpu()
    h = hashlib.sha256(f"{dtype_name(t.dtype)}{list(t.shape)}".encode())
    h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def check_overlaps(merged: Merged, digests: Sequence[dict[tuple[str, StageKey], str]]) -> None:
    """The same name in two stages must hold the same value (then it is sent once)."""
    known: dict[tuple[str, StageKey], str] = {}
    for d in digests:
        known.update(d)
    for name, keys in merged.overlaps.items():
        want = known.get((name, keys[0]))
        for key in keys[1:]:
            got = known.get((name, key))
            if want is None or got is None or got != want:
                raise LayoutError(
                    f"tensor {name!r} is in {describe(keys[0])} and in {describe(key)} with "
                    f"different values: stages overlap (tie the copies or drop one)")
