"""`WeightSource` over Megatron-Core model chunks (TP / PP / virtual PP / EP / ETP / CP / DP).

Design (PP): every tensor is sent by the FIRST rank of the pipeline stage that owns it (the
lowest default-group rank of that stage, i.e. TP/CP/DP/EP/ETP rank 0). `source_rank` values
are default-group (`torch.distributed.WORLD`) ranks of the training job; the refit group must
number the training ranks the same way. Nothing crosses pipeline stages, so no rank ever holds
another stage's weights; ranks outside the owning stage yield None for those specs, and only
the owning stage's data-parallel replica 0 runs gathers (other replicas yield None at once).

Specs come from metadata only: each rank lists its stage's tensors (canonical name, global
shape from local shape x TP/ETP size along `partition_dim`, EP-expanded expert ids) and the
lists are exchanged once over the pipeline group with `all_gather_object`, so every rank holds
the same specs in the same global order (embedding, layers by global index, final norm,
output layer) however the layers are spread over stages and virtual chunks.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from common.dtype_policy import DtypePolicy
from common.errors import ConversionError
from common.plan import RefitPlan, TensorSpec
from mcore_refit import names
from mcore_refit.convert import Converter, Dims, Target
from mcore_refit.gather import gather_experts, gather_partitioned


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
        return self.order, self.name, self.expert_ids, self.targets


class MegatronWeightSource:
    """Gathers and converts a Megatron-Core model (list of virtual-pipeline chunks) to HF.

    `policy` declares each HF tensor's output dtype (`common.dtype_policy`; default bf16 with
    the router expert bias fp32); it needs a `dtype` (every Megatron param is floating).
    `vocab_size` is the true vocabulary; padded rows are dropped.
    Tied embeddings (`share_embeddings_and_output_weights`) send no `lm_head`.
    Construct on every training rank at the same time: it runs one metadata exchange.
    """

    def __init__(self, chunks: Sequence[torch.nn.Module] | torch.nn.Module,
                 converter: Converter, *, vocab_size: int,
                 policy: DtypePolicy | None = None) -> None:
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
        stage_group = ps.get_tensor_and_data_parallel_group(with_context_parallel=True)
        self.stage_first = min(dist.get_process_group_ranks(stage_group))
        self.dense_active = ps.get_data_parallel_rank(with_context_parallel=True) == 0
        self.expert_active = (self.num_experts == 0
                              or ps.get_expert_data_parallel_rank() == 0)
        local = self._local_units(self.chunks, inner)
        self._local = {u.order: u for u in local}
        gathered: list = [None] * ps.get_pipeline_model_parallel_world_size()
        dist.all_gather_object(gathered, (self.stage, self.stage_first,
                                          [u.meta() for u in local]),
                               group=ps.get_pipeline_model_parallel_group())
        units: list[_Unit] = []
        self.first_rank: dict[int, int] = {}
        for stage, first, metas in gathered:
            self.first_rank[stage] = first
            for order, name, experts, targets in metas:
                unit = self._local[order] if stage == self.stage else _Unit(
                    order, name, experts, targets)
                unit.stage = stage
                units.append(unit)
        units.sort(key=lambda u: u.order)
        self.units = units
        self._where: dict[str, _Where] = {}
        for u, unit in enumerate(units):
            for m, member in enumerate(unit.targets):
                for t, target in enumerate(member):
                    if target.name in self._where:
                        raise ValueError(f"two Megatron tensors map to {target.name!r}")
                    self._where[target.name] = _Where(u, m, t)
        # each HF tensor's declared dtype, decided once (not per tensor per refit)
        self._dtypes = {n: self.policy.dtype_for(n, self.policy.dtype) for n in self._where}

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
        for unit in self.units:
            source = self.first_rank[unit.stage]
            for member in unit.targets:
                for t in member:
                    specs.append(TensorSpec(t.name, t.shape, self._dtypes[t.name], source))
        return specs

    # --- data ---------------------------------------------------------------------------
    def _materialise(self, unit: _Unit) -> list[list[torch.Tensor]] | None:
        """Run the unit's gathers (on its stage's active ranks); outputs on the source only."""
        if unit.stage != self.stage or unit.tensor is None:
            return None
        local = unit.tensor.detach()
        if unit.expert_ids:
            if not self.expert_active:
                return None
            group = ps.get_expert_tensor_parallel_group() if unit.tp else None
            full = gather_partitioned(local, group, unit.dim, unit.stride) if unit.tp else local
            fulls = gather_experts(full, ps.get_expert_model_parallel_group())
            canonical = [unit.name.format(E=e) for e in unit.expert_ids]
        else:
            if not self.dense_active:
                return None
            if unit.tp:
                local = gather_partitioned(local, ps.get_tensor_model_parallel_group(),
                                           unit.dim, unit.stride)
            fulls, canonical = [local], [unit.name]
        if self.rank != self.first_rank[unit.stage]:
            return None
        out = []
        for name, full, member in zip(canonical, fulls, unit.targets, strict=True):
            pieces = self.converter.convert(name, full, self.dims)
            out.append([p.to(self._dtypes[t.name]) for p, t in zip(pieces, member, strict=True)])
        return out

    def iter_tensors(self, plan: RefitPlan) -> Iterator[tuple[str, torch.Tensor | None]]:
        missing = [s.name for s in plan.specs if s.name not in self._where]
        if missing:
            raise ConversionError(f"plan names tensors this Megatron model does not have: "
                                  f"{missing[:5]}{' ...' if len(missing) > 5 else ''}")
        cache: dict[int, list[list[torch.Tensor]] | None] = {}
        left: dict[int, int] = {}
        for spec in plan.specs:
            where = self._where[spec.name]
            u = where.unit
            if u not in cache:
                cache[u] = self._materialise(self.units[u])
                left[u] = sum(len(m) for m in self.units[u].targets)
            outputs = cache[u]
            yield spec.name, None if outputs is None else outputs[where.member][where.target]
            left[u] -= 1
            if left[u] == 0:
                del cache[u]
