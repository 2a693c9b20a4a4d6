"""A WeightSource over FSDP2 / TP / HSDP / EP (DTensor) transformers models, whole or in stages.

The specs are computed once, from metadata. A whole model (one module) lists them the same way
on every rank with no collective; pipeline stages (a list of model parts) merge theirs with one
metadata exchange (`dtensor_refit.stages`). Each refit walks the plan in order; for a DTensor
`full_tensor()` is an all-gather over the mesh dimensions it is sharded on, so the ranks of the
spec's source replica run it in plan order and the source keeps the result. Ranks whose
coordinate on a replicated mesh dimension (HSDP's replicate dimension) differs from the
source's, and ranks of other stages, run no gather at all: they yield None at once. A fused
expert tensor split over ranks is sent expert by expert from the ranks holding them (at most a
gather inside each EP group, `dtensor_refit.experts`); otherwise it is gathered once and split.
At most one gathered tensor is alive here at a time, never the whole model.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from common.dtype_policy import DtypePolicy
from common.errors import ConversionError
from common.plan import RefitPlan, TensorSpec, dtype_from_name, dtype_name
from dtensor_refit import experts, stages
from dtensor_refit.layout import LayoutError, model_entries
from dtensor_refit.names import Entry, split_experts

log = logging.getLogger(__name__)


def reshard_fsdp(model: torch.nn.Module) -> None:
    """Put FSDP2's sharded parameters back into every module (local, no collective).

    After a no_grad forward FSDP2 leaves the root's parameters unsharded (plain tensors, in
    the mixed-precision param dtype): the sharded fp32 master is what must be sent.
    """
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def _lookup(model: torch.nn.Module, key: str) -> torch.Tensor:
    path, _, attr = key.rpartition(".")
    tensor = getattr(model.get_submodule(path) if path else model, attr)
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{key!r} is no longer a tensor on the training model")
    return tensor


def _full(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor: a collective for a DTensor (every rank of its mesh must call it)."""
    from torch.distributed._functional_collectives import AsyncCollectiveTensor

    with torch.no_grad():
        if not isinstance(tensor, DTensor):
            return tensor.detach()
        full = tensor.full_tensor()
        # finish the gather here, so a rank that drops the result frees finished memory
        return full.wait() if isinstance(full, AsyncCollectiveTensor) else full


def gathers_here(tensor: DTensor, source: int) -> bool:
    """Whether this rank takes part in gathering `tensor` for `source` (a default-group rank).

    `full_tensor()` gathers only along the mesh dimensions the tensor is sharded on, among
    ranks that share its coordinates on the replicated ones; the replica holding `source` is
    the only one whose result is used. A mesh without `source` (another stage, or an implicit
    replica such as one dp group per ep coordinate) gathers nothing either.
    """
    mesh = tensor.device_mesh
    hit = (mesh.mesh == source).nonzero()
    mine = mesh.get_coordinate()
    if hit.numel() == 0 or mine is None:
        return False
    theirs = hit[0].tolist()
    return all(s == m for s, m, p in zip(theirs, mine, tensor.placements, strict=True)
               if p.is_replicate())


class DTensorWeightSource:
    """Weights of an HF transformers model sharded with FSDP2 / HSDP / TP / EP, in checkpoint form.

    `model` is the whole model, or the list of model parts (pipeline stages) this rank holds;
    with parts, construct on every rank of `group` (default: the default group) at the same
    time: one metadata exchange, waited at most `timeout_s` on gloo. Source ranks are then the
    first rank of each tensor's stage, as default-group ranks: number the refit group's
    training ranks the same way. A whole model is sent from `source_rank` (default 0).
    `rank` is this process's refit rank (default: its default-group rank).
    `check_names=False` skips the cross-check against transformers' save_pretrained mapping.
    `expert_sources="owner"` sends each expert of a fused expert tensor split over ranks from a
    rank holding it (`dtensor_refit.experts`); "gather" gathers it whole to one source rank.
    """

    def __init__(self, model: torch.nn.Module | Sequence[torch.nn.Module],
                 policy: DtypePolicy | None = None, *, rank: int | None = None,
                 source_rank: int | None = None, check_names: bool = True,
                 group: dist.ProcessGroup | None = None, timeout_s: float = 300.0,
                 expert_sources: str = "owner") -> None:
        staged = not isinstance(model, torch.nn.Module)
        self.parts: list[torch.nn.Module] = list(model) if staged else [model]
        if not self.parts:
            raise ValueError("DTensorWeightSource needs a model or at least one model part")
        if staged and source_rank is not None:
            raise ValueError("source_rank is for a whole model; stages send from their first rank")
        if staged and not (dist.is_available() and dist.is_initialized()):
            raise ValueError("model parts (pipeline stages) need torch.distributed initialised")
        self.model = self.parts[0]
        self.policy = policy or DtypePolicy()
        if rank is None:
            rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        self.rank = rank
        self.source_rank = None if staged else (source_rank or 0)
        if expert_sources not in ("owner", "gather"):
            raise ValueError(f"expert_sources must be 'owner' or 'gather', not {expert_sources!r}")
        self.expert_sources = expert_sources
        self._owners: dict[int, experts.Owners] = {}  # fused entry -> its experts' owners
        self._source_of: dict[str, int] = {}  # checkpoint name -> the expert's owner
        self.entries: list[Entry] = []
        self._part_of: list[int] = []
        self._where: dict[str, tuple[int, int]] = {}  # checkpoint name -> (entry, piece)
        self._replica: dict[tuple[int, int], bool] = {}  # (entry, source) -> gathers here
        if staged:
            self._specs = self._merge_stages(group, timeout_s, check_names)
        else:
            self._specs = [TensorSpec(n, s, dtype_from_name(d),
                                      self._source_of.get(n, self.source_rank))
                           for n, s, d in self._list_part(0, check_names)]
        self._known = {s.name for s in self._specs}

    @property
    def is_source(self) -> bool:
        return self.rank == self.source_rank or self.rank in self._source_of.values()

    def _list_part(self, p: int, check: bool) -> list[stages.Meta]:
        """(name, shape, declared dtype) of part `p`'s tensors, from metadata; indexes them."""
        part = self.parts[p]
        out: list[stages.Meta] = []
        for entry in model_entries(part, check=check):
            i = len(self.entries)
            self.entries.append(entry)
            self._part_of.append(p)
            raw = _lookup(part, entry.key)
            dtype = raw.dtype
            if self.expert_sources == "owner" and (
                    owners := experts.for_entry(entry, raw, self.rank)) is not None:
                self._owners[i] = owners
                self._source_of.update(zip(entry.names, experts.name_sources(entry.kind, owners),
                                           strict=True))
            for j, (name, shape) in enumerate(zip(entry.names, entry.shapes, strict=True)):
                out.append((name, shape, dtype_name(self.policy.dtype_for(name, dtype))))
                self._where.setdefault(name, (i, j))  # a name in two own parts: the first
        return out

    def _merge_stages(self, group: dist.ProcessGroup | None, timeout_s: float,
                      check: bool) -> list[TensorSpec]:
        """List own parts, exchange once, merge; every rank raises the same error if any fails."""
        parts: list[tuple[stages.StageKey, tuple[stages.Meta, ...]]] = []
        error, expected = None, None
        try:
            for p in range(len(self.parts)):
                key = (stages.part_ranks(self.parts[p], dist.get_rank()), p)
                parts.append((key, tuple(self._list_part(p, check))))
            expected = stages.whole_model(self.parts[0], check)
        except Exception as e:  # noqa: BLE001 - sent to every rank, raised everywhere
            error = f"{type(e).__name__}: {e}"
        self._keys = [k for k, _ in parts]
        report = stages.Report(self.rank, tuple(parts), error,
                               tuple(sorted(self._source_of.items())))
        reports = stages.exchange(report, group, timeout_s)
        merged = stages.merge(reports)
        stages.check_complete(merged.specs, expected)
        if merged.overlaps:
            digests, error = {}, None
            try:
                digests = self._overlap_digests(merged)
            except Exception as e:  # noqa: BLE001 - raised on every rank below
                error = f"rank {self.rank}: {type(e).__name__}: {e}"
            answers = stages.exchange((digests, error), group, timeout_s)
            if errors := [e for _, e in answers if e]:
                raise LayoutError("checking tensors held by several stages failed: "
                                  + "; ".join(errors))
            stages.check_overlaps(merged, [d for d, _ in answers])
            log.info("%d tensors held by several pipeline stages, sent once each",
                     len(merged.overlaps))
        return list(merged.specs)

    def _overlap_digests(self, merged: stages.Merged) -> dict[tuple[str, stages.StageKey], str]:
        """A value digest of each tensor several stages hold, per own stage (gathers in-stage)."""
        out: dict[tuple[str, stages.StageKey], str] = {}
        for spec in merged.specs:
            holders = merged.overlaps.get(spec.name, ())
            for p, key in enumerate(self._keys):
                if key not in holders:
                    continue
                i = next(i for i, e in enumerate(self.entries)
                         if self._part_of[i] == p and spec.name in e.names)
                entry = self.entries[i]
                full = _full(_lookup(self.parts[p], entry.key))
                if entry.kind != "plain":
                    full = list(split_experts(entry.kind, full))[entry.names.index(spec.name)]
                out[(spec.name, key)] = stages.digest(full)
        return out

    def plan_specs(self) -> list[TensorSpec]:
        """Every checkpoint tensor of the whole model; computed at construction from metadata."""
        return list(self._specs)

    def _take(self, i: int, source: int) -> torch.Tensor | None:
        """Entry i's full tensor on `source`; a gather only on the ranks of the source replica."""
        raw = _lookup(self.parts[self._part_of[i]], self.entries[i].key)
        keep = self.rank == source
        if not isinstance(raw, DTensor):
            return raw.detach() if keep else None
        here = self._replica.get((i, source))
        if here is None:
            here = self._replica[(i, source)] = gathers_here(raw, source)
        if not here:
            return None
        full = _full(raw)  # a collective: every rank of the source's replica runs it
        return full if keep else None  # off the source: gathered for the collective only

    def _fused(self, i: int, source: int) -> dict[int, torch.Tensor]:
        """Entry i's per-expert tensors this rank sends, by index in the entry's names."""
        owners, kind = self._owners.get(i), self.entries[i].kind
        if owners is None:
            full = self._take(i, source)
            return {} if full is None else dict(enumerate(split_experts(kind, full)))
        raw = _lookup(self.parts[self._part_of[i]], self.entries[i].key)
        return experts.own_pieces(kind, owners, owners.rows(raw))

    def iter_tensors(self, plan: RefitPlan) -> Iterator[tuple[str, torch.Tensor | None]]:
        """(name, full tensor in the declared dtype) per plan spec, in plan order.

        Yields None off each spec's source rank; another stage's tensor costs nothing here. A
        fused expert group that is contiguous in the plan (as plan_specs lists it) is gathered
        (or read from the owners' shards) once.
        """
        for part in self.parts:
            reshard_fsdp(part)
        cached: tuple[int, dict[int, torch.Tensor]] | None = None
        for spec in plan.specs:
            where = self._where.get(spec.name)
            if where is None:
                if spec.name not in self._known:
                    raise ConversionError(f"plan tensor {spec.name!r} is not a tensor of this "
                                          f"model")
                yield spec.name, None  # another stage's tensor
                continue
            i, j = where
            entry = self.entries[i]
            tensor: torch.Tensor | None
            if entry.kind == "plain":
                cached = None
                tensor = self._take(i, spec.source_rank)
            else:
                if cached is None or cached[0] != i:
                    cached = None  # drop the previous fused tensor before gathering the next
                    cached = (i, self._fused(i, spec.source_rank))
                tensor = cached[1].get(j)
                if tensor is None and spec.source_rank == self.rank:
                    raise RuntimeError(f"the plan sends {spec.name!r} from rank {self.rank}, "
                                       f"which does not hold it: build the plan from "
                                       f"this source's plan_specs()")
            if tensor is not None and tensor.dtype != spec.dtype:
                tensor = tensor.to(spec.dtype)
            yield spec.name, tensor
            del tensor
