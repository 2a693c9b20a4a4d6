"""The weight-source protocol that the Megatron and DTensor gatherers implement."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Protocol, runtime_checkable

import torch

from common.plan import RefitPlan, TensorSpec


@runtime_checkable
class WeightSource(Protocol):
    """Where the sender gets full, converted tensors from.

    `plan_specs()` lists every tensor (name, global shape, declared output dtype, source rank)
    from metadata alone, identically on every training rank. `iter_tensors(plan)` yields one
    `(name, tensor)` per plan spec in plan order on every training rank, running whatever
    collectives (gathers) it needs there; on a rank that is not a spec's source the tensor may
    be None. The sender drains the iterator even after an error, so those collectives stay in
    the same order on every rank.
    """

    def plan_specs(self) -> list[TensorSpec]: ...

    def iter_tensors(self, plan: RefitPlan) -> Iterator[tuple[str, torch.Tensor | None]]: ...


class DictWeightSource:
    """A weight source over a dict of full tensors (replicated or held by `source_rank`).

    `dtypes` declares the dtype the receiver must get for some names (e.g. bf16 for weights,
    fp32 for a router bias); the tensor is cast to it when yielded. Names not listed keep the
    dtype the tensor has when the specs are listed.
    """

    def __init__(
        self,
        tensors: Mapping[str, torch.Tensor],
        dtypes: Mapping[str, torch.dtype] | None = None,
        source_rank: int = 0,
    ) -> None:
        self.tensors = tensors
        self.dtypes = dict(dtypes or {})
        self.source_rank = source_rank

    def plan_specs(self) -> list[TensorSpec]:
        return [
            TensorSpec(name, tuple(t.shape), self.dtypes.get(name, t.dtype), self.source_rank)
            for name, t in self.tensors.items()
        ]

    def iter_tensors(self, plan: RefitPlan) -> Iterator[tuple[str, torch.Tensor | None]]:
        """C-level `map`/`zip`: at tens of thousands of tensors a Python generator's cost per
        item is a visible share of an NVLink refit."""
        names = [spec.name for spec in plan.specs]
        tensors = map(self.tensors.get, names)
        if self.dtypes:
            tensors = map(self._declared, names, tensors)
        return zip(names, tensors, strict=True)

    def _declared(self, name: str, tensor: torch.Tensor | None) -> torch.Tensor | None:
        dtype = self.dtypes.get(name)
        return tensor if dtype is None or tensor is None else tensor.to(dtype)
