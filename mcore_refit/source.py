"""`WeightSource` over Megatron-Core model chunks (TP / PP / virtual PP / EP / ETP / CP / DP).

Sources (`sources=`). Nothing crosses pipeline stages: a stage's tensors are sent by ranks of
that stage. With `"spread"` (the default) a stage has several sources, so that the concurrent
sources of `common.transfer.schedule` share the sending: each expert comes from a rank that
owns it (its EP rank's expert-TP rank 0 in one of the expert-data-parallel replicas; no gather
over EP), each dense tensor from one rank of the stage (DP / CP / EP replicas hold it alike;
after its TP all-gather every rank of the TP group holds it), all chosen by bytes
(`common.plan.balance_sources`, every rank the same); `mcore_refit.placement` has the rules.
With `"stage"` every tensor comes from the stage's FIRST rank (lowest default-group rank:
TP/CP/DP/EP/ETP rank 0), experts gathered over EP onto it: one source per stage, for fewer
stream communicators (each source has its own with the receivers) or receivers that should
reach one rank per stage, at the cost of the EP gather and of one sender per stage.
`source_rank` values are default-group (`torch.distributed.WORLD`) ranks of the training job;
the refit group must number the training ranks the same way. A rank yields None for tensors
it does not send, and only the ranks whose result is used run gathers (a dense tensor's
source's TP group; an expert's source's expert-TP group, with `"stage"` every expert-TP group
of expert-data-parallel replica 0); the others yield None at once.

Specs come from metadata only: each rank lists its stage's tensors (canonical name, global
shape from local shape x TP/ETP size along `partition_dim`, EP-expanded expert ids) and the
lists are exchanged once over the pipeline group with `all_gather_object` (with `"spread"`
after one exchange of each rank's EP / ETP / EDP ranks over its stage), so every rank holds
the same specs with the same sources. Specs are in global order (embedding, layers by global
index, final norm, output layer) however the layers are spread over stages and virtual
chunks; with `"spread"` grouped by source rank (stably), since a bucket never mixes sources:
`RefitPlan.build` then takes the sources' buckets in turn.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from common.dtype_policy import DtypePolicy
from common.errors import ConversionError
from common.plan import RefitPlan, TensorSpec, balance_sources
from mcore_refit import names
from mcore_refit.convert import Converter, Dims, Target
from mcore_refit.gather import gather_experts, gather_partitioned
from mcore_refit.placement import StagePlacement, group_ranks, place_stage, stage_infos

SOURCES = ("spread", "stage")


class _Where(NamedTuple):
    """Where an HF tensor comes from: unit index, member (expert) index, target index."""

    unit: int
    member: int
    target: int


@dataclass
class _Unit:
    """One Megatron tensor (or one local expert slot across the EP group) -> HF tensors."""

    order: tuple[int, int, int]
    name: str  # canonical Megatron name; for experts a template with {E}
    expert_ids: tuple[int, ...]  # global expert ids in EP-rank order; () when not an expert
    targets: tuple[tuple[Target, ...], ...]  # one tuple per member (expert) or a single one
    stage: int = -1
    tensor: torch.Tensor | None = field(default=None, repr=False)  # local piece, own stage
    tp: bool = False
    dim: int = 0
    stride: int = 1

    def meta(self) -> tuple:
        return self.order, self.name, self.expert_ids, self.targets, self.tp


class MegatronWeightSource:
    """Gathers and converts a Megatron-Core model (list of virtual-pipeline chunks) to HF.

    `policy` declares each HF tensor's output dtype (`common.dtype_policy`; default bf16 with
    the router expert bias fp32); it needs a `dtype` (every Megatron param is floating).
    `vocab_size` is the true vocabulary; padded rows are dropped.
    Tied embeddings (`share_embeddings_and_output_weights`) send no `lm_head`.
    `sources`: `"spread"` (default) sends each expert from one of its owners (one per
    expert-data-parallel replica) and spreads the dense tensors over the stage's ranks, all
    bytes balanced, so several ranks per stage send at once
    (with `RefitConfig.concurrent_sources`) and experts never cross EP; `"stage"` sends a whole
    stage from its first rank (fewer stream communicators, receivers that reach one rank per
    stage; the experts gathered over EP). The module doc has the details.
    Construct on every training rank at the same time: it runs the metadata exchanges.
    """

    def __init__(self, chunks: Sequence[torch.nn.Module] | torch.nn.Module,
                 converter: Converter, *, vocab_size: int,
                 policy: DtypePolicy | None = None, sources: str = "spread") -> None:
        if sources not in SOURCES:
            raise ValueError(f"sources={sources!r}: expected one of {SOURCES}")
        if isinstance(chunks, torch.nn.Module):
            chunks = [chunks]
        self.chunks = list(chunks)
        self.converter = converter
        self.policy = policy or DtypePolicy()
        if self.policy.dtype is None:
            raise ValueError("MegatronWeightSource needs a DtypePolicy with a dtype")
        inner = [names.unwrap(c) for c in self.chunks]
        cfg = inner[0].config
        heads = cfg.num_attention_heads
        self.dims = Dims(num_heads=heads, num_query_groups=cfg.num_query_groups or heads,
                         head_dim=cfg.kv_channels or cfg.hidden_size // heads,
                         vocab_size=vocab_size)
        self.tied = bool(getattr(inner[0], "share_embeddings_and_output_weights", False))
        self.num_experts = cfg.num_moe_experts or 0
        self.stage = ps.get_pipeline_model_parallel_rank()
        self.rank = dist.get_rank()
        self.tp_ranks = group_ranks(ps.get_tensor_model_parallel_group())
        self.ep_rank = ps.get_expert_model_parallel_rank()
        self.edp_rank = ps.get_expert_data_parallel_rank()
        self.sources = sources
        self.units, self.placements = self._exchange(self._local_units(self.chunks, inner))
        self._where: dict[str, _Where] = {}
        for u, unit in enumerate(self.units):
            for m, member in enumerate(unit.targets):
                for t, target in enumerate(member):
                    if target.name in self._where:
                        raise ValueError(f"two Megatron tensors map to {target.name!r}")
                    self._where[target.name] = _Where(u, m, t)
        # each HF tensor's declared dtype, decided once (not per tensor per refit)
        self._dtypes = {n: self.policy.dtype_for(n, self.policy.dtype) for n in self._where}
        self._sources = self._assign_sources()  # per unit, per member: its source rank
        self._checked = ""  # digest of the last plan checked against this source

    def _exchange(self, local: list[_Unit]) -> tuple[list[_Unit], dict[int, StagePlacement]]:
        """Every stage's units in global order, and every stage's placement (one exchange
        over the pipeline group)."""
        mine = {u.order: u for u in local}
        gathered: list = [None] * ps.get_pipeline_model_parallel_world_size()
        dist.all_gather_object(gathered, (self.stage, self._place(local, self.sources),
                                          [u.meta() for u in local]),
                               group=ps.get_pipeline_model_parallel_group())
        units: list[_Unit] = []
        placements: dict[int, StagePlacement] = {}
        for stage, placement, metas in gathered:
            placements[stage] = placement
            for order, name, experts, targets, tp in metas:
                unit = mine[order] if stage == self.stage else _Unit(
                    order, name, experts, targets, tp=tp)
                unit.stage = stage
                units.append(unit)
        units.sort(key=lambda u: u.order)
        return units, placements

    def _place(self, local: list[_Unit], sources: str) -> StagePlacement:
        """This stage's candidate sources (`mcore_refit.placement`); every rank of the stage
        computes the same from the same exchanged ranks."""
        stage_group = ps.get_tensor_and_data_parallel_group(with_context_parallel=True)
        first = min(dist.get_process_group_ranks(stage_group))
        if sources == "stage":
            return StagePlacement(first)
        return place_stage(stage_infos(stage_group), any(u.expert_ids for u in local))

    def _assign_sources(self) -> list[tuple[int, ...]]:
        """Each unit's source rank per member: one of its candidates (an expert's: its
        owners, one per expert-data-parallel replica; a dense tensor's: the stage's ranks),
        chosen by `balance_sources` over whole units (an HF tensor goes with the other tensors
        its Megatron tensor converts to)."""
        specs, candidates = [], {}
        for u, unit in enumerate(self.units):
            placement = self.placements[unit.stage]
            for m, member in enumerate(unit.targets):
                ranks = placement.candidates(m if unit.expert_ids else None)
                nbytes = sum(math.prod(t.shape) * self._dtypes[t.name].itemsize for t in member)
                key = f"{u}/{m}"
                specs.append(TensorSpec(key, (nbytes,), torch.uint8, ranks[0]))
                candidates[key] = ranks
        chosen = iter([s.source_rank for s in balance_sources(specs, candidates)])
        return [tuple(next(chosen) for _ in unit.targets) for unit in self.units]

    # --- metadata -----------------------------------------------------------------------
    def _entries(self, wrapped: torch.nn.Module, model: torch.nn.Module,
                 slots: int) -> Iterator[names.LocalTensor]:
        """This chunk's tensors that convert to HF ones (rotary tables etc. left out)."""
        offsets = names.layer_offsets(model)
        tensors = [(n, p, True) for n, p in wrapped.named_parameters()]
        tensors += [(n, b, False) for n, b in wrapped.named_buffers()]
        for raw, tensor, is_param in tensors:
            name = names.strip_module_prefixes(raw)
            if names.skipped(name) or (self.tied and name == "output_layer.weight"):
                continue
            name, layer = names.globalize_layer(name, offsets)
            grouped = names.grouped_slots(name, tensor, slots)
            if grouped is not None:
                yield from (entry._replace(layer=layer) for entry in grouped)
                continue
            found = names.expert_slot(name)
            probe = found[0].format(E=0) if found else name
            if self.converter.match(probe) is None:
                if is_param:
                    raise ConversionError(f"{self.converter.name}: no conversion rule for "
                                          f"Megatron parameter {probe!r} (from {raw!r})")
                continue  # non-weight buffers (rotary tables, token counters)
            is_tp = bool(getattr(tensor, "tensor_model_parallel", False))
            dim = int(getattr(tensor, "partition_dim", 0)) if is_tp else 0
            stride = int(getattr(tensor, "partition_stride", 1)) if is_tp else 1
            name, slot = found if found else (name, None)
            yield names.LocalTensor(name, layer, slot, tensor, is_tp, dim, stride)

    def _local_units(self, chunks: list[torch.nn.Module],
                     inner: list[torch.nn.Module]) -> list[_Unit]:
        ep = ps.get_expert_model_parallel_world_size()
        tp = ps.get_tensor_model_parallel_world_size()
        etp = ps.get_expert_tensor_parallel_world_size()
        slots = self.num_experts // ep if self.num_experts else 0
        units: list[_Unit] = []
        seen: set[tuple[str, int | None]] = set()
        for wrapped, model in zip(chunks, inner, strict=True):
            for name, layer, slot, tensor, is_tp, dim, stride in self._entries(
                    wrapped, model, slots):
                if (name, slot) in seen:  # shared / tied parameters appear once
                    continue
                seen.add((name, slot))
                shape = list(tensor.shape)
                if is_tp:
                    shape[dim] *= etp if slot is not None else tp
                if slot is not None:
                    ids = tuple(e * slots + slot for e in range(ep))
                    targets = tuple(tuple(self.converter.targets(
                        name.format(E=e), tuple(shape), self.dims)) for e in ids)
                else:
                    ids = ()
                    targets = (tuple(self.converter.targets(name, tuple(shape), self.dims)),)
                order = (names.section(name), layer, len(units))
                units.append(_Unit(order, name, ids, targets, tensor=tensor, tp=is_tp,
                                   dim=dim, stride=stride))
        return units

    def plan_specs(self) -> list[TensorSpec]:
        specs = []
        for unit, sources in zip(self.units, self._sources, strict=True):
            for member, source in zip(unit.targets, sources, strict=True):
                for t in member:
                    specs.append(TensorSpec(t.name, t.shape, self._dtypes[t.name], source))
        if self.sources == "spread":
            specs.sort(key=lambda s: s.source_rank)  # stable: global order per source
        return specs

    def _source_of(self, name: str) -> int:
        where = self._where[name]
        return self._sources[where.unit][where.member]

    def _check_plan(self, plan: RefitPlan) -> None:
        """Every plan tensor is one of ours, from the rank that sends it here (once a plan)."""
        if plan.digest == self._checked:
            return
        missing = [s.name for s in plan.specs if s.name not in self._where]
        if missing:
            raise ConversionError(f"plan names tensors this Megatron model does not have: "
                                  f"{missing[:5]}{' ...' if len(missing) > 5 else ''}")
        moved = [s for s in plan.specs if s.source_rank != self._source_of(s.name)]
        if moved:
            raise ConversionError(
                f"plan sends {moved[0].name!r} from rank {moved[0].source_rank}, this Megatron "
                f"source from rank {self._source_of(moved[0].name)} ({len(moved)} such "
                f"tensors; build the plan from plan_specs(), same `sources=` on every rank)")
        self._checked = plan.digest

    # --- data ---------------------------------------------------------------------------
    def _expert_fulls(self, unit: _Unit, sources: tuple[int, ...]
                      ) -> list[torch.Tensor | None] | None:
        """The full tensor of each expert of the unit this rank may send (None: not here).
        `"spread"`: the expert-TP group of this rank's EP rank's source gathers (the source is
        its expert-TP rank 0: the group's ranks share the EP and expert-DP rank, so all or none
        of them gather); `"stage"`: replica 0's expert-TP groups, then its EP groups."""
        placement = self.placements[self.stage]
        if placement.spread:
            active = sources[self.ep_rank] == placement.owners[self.ep_rank][self.edp_rank]
        else:
            active = self.edp_rank == 0
        if not active:
            return None
        local = unit.tensor.detach()
        full = gather_partitioned(local, ps.get_expert_tensor_parallel_group(), unit.dim,
                                  unit.stride) if unit.tp else local
        if placement.spread:
            return [full if m == self.ep_rank else None for m in range(len(unit.expert_ids))]
        return gather_experts(full, ps.get_expert_model_parallel_group())

    def _dense_full(self, unit: _Unit, source: int) -> torch.Tensor | None:
        """The full dense tensor on its source (its TP group gathers; no other rank does)."""
        local = unit.tensor.detach()
        if unit.tp:
            if source not in self.tp_ranks:
                return None
            local = gather_partitioned(local, ps.get_tensor_model_parallel_group(), unit.dim,
                                       unit.stride)
        return local if self.rank == source else None

    def _materialise(self, u: int) -> list[list[torch.Tensor] | None] | None:
        """Run the unit's gathers (on the ranks whose result is used); each member's
        converted outputs on its source only (None elsewhere)."""
        unit, sources = self.units[u], self._sources[u]
        if unit.stage != self.stage or unit.tensor is None:
            return None
        if unit.expert_ids:
            fulls = self._expert_fulls(unit, sources)
            canonical = [unit.name.format(E=e) for e in unit.expert_ids]
        else:
            fulls, canonical = [self._dense_full(unit, sources[0])], [unit.name]
        if fulls is None or self.rank not in sources:
            return None
        out: list[list[torch.Tensor] | None] = []
        for name, full, member, source in zip(canonical, fulls, unit.targets, sources,
                                              strict=True):
            if full is None or source != self.rank:
                out.append(None)
                continue
            pieces = self.converter.convert(name, full, self.dims)
            out.append([p.to(self._dtypes[t.name]) for p, t in zip(pieces, member, strict=True)])
        return out

    def iter_tensors(self, plan: RefitPlan) -> Iterator[tuple[str, torch.Tensor | None]]:
        self._check_plan(plan)
        cache: dict[int, list[list[torch.Tensor] | None] | None] = {}
        left: dict[int, int] = {}
        for spec in plan.specs:
            where = self._where[spec.name]
            u = where.unit
            if u not in cache:
                cache[u] = self._materialise(u)
                left[u] = sum(len(m) for m in self.units[u].targets)
            outputs = cache[u]
            member = None if outputs is None else outputs[where.member]
            yield spec.name, None if member is None else member[where.target]
            left[u] -= 1
            if left[u] == 0:
                del cache[u]
