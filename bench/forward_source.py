"""Rank 0 as the only refit source: every other training rank's tensors hop to it first.

The alternative to each owner (a pipeline stage, an expert-parallel rank) feeding the refit
group itself, for the benchmark's comparison: per bucket the owners send their tensors to
training rank 0 over the training job's own group (one batched point-to-point call), then rank
0 packs and broadcasts every bucket.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import replace

import torch
import torch.distributed as dist

from common.plan import RefitPlan, TensorSpec


class ForwardingSource:
    """A weight source whose plan names rank 0 as every bucket's source; each of `specs` is
    held by its `source_rank` (a training rank of the default group), `tensors` are this
    rank's."""

    def __init__(self, tensors: Mapping[str, torch.Tensor], specs: list[TensorSpec], rank: int,
                 device: torch.device) -> None:
        self.tensors, self.specs, self.rank, self.device = tensors, specs, rank, device
        self.owner = {s.name: s.source_rank for s in specs}

    def plan_specs(self) -> list[TensorSpec]:
        return [replace(s, source_rank=0) for s in self.specs]

    def iter_tensors(self, plan: RefitPlan) -> Iterator[tuple[str, torch.Tensor | None]]:
        for bucket in plan.buckets:
            yield from self._bucket(plan.bucket_specs(bucket))

    def _bucket(self, specs: tuple[TensorSpec, ...]) -> Iterator[tuple[str, torch.Tensor | None]]:
        """Every owner's tensors of one bucket reach rank 0 in one batched exchange."""
        ops, got = [], {}
        for s in specs:
            owner = self.owner[s.name]
            if owner == 0:
                continue
            if self.rank == 0:
                got[s.name] = torch.empty(s.shape, dtype=s.dtype, device=self.device)
                ops.append(dist.P2POp(dist.irecv, got[s.name], owner))
            elif self.rank == owner:
                ops.append(dist.P2POp(dist.isend, self.tensors[s.name], 0))
        if ops:
            for work in dist.batch_isend_irecv(ops):
                work.wait()
        for s in specs:
            yield s.name, (got.get(s.name, self.tensors.get(s.name)) if self.rank == 0 else None)
