"""A WeightSource over an FSDP2 / TP (DTensor) transformers model: one full tensor at a time.

The specs are computed once, from metadata, the same way on every training rank, so listing
them runs no collective. Each refit walks the plan in order; for a DTensor `full_tensor()` is
an all-gather over its mesh, so EVERY training rank runs it, in plan order (the plan is the
same everywhere), and only the source rank keeps the result. A fused expert tensor is gathered
once and split per expert afterwards; at most one gathered tensor is alive here at a time (the
broadcaster's buckets hold the rest), never the whole model.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from common.plan import RefitPlan, TensorSpec
from dtensor_refit.layout import model_entries
from dtensor_refit.names import Entry, split_experts
from dtensor_refit.policy import DtypePolicy

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


class DTensorWeightSource:
    """Weights of an HF transformers model sharded with FSDP2 and/or TP, in checkpoint form.

    `rank` is this process's refit rank (default: its default-group rank); every spec comes
    from `source_rank` (training rank 0). `check_names=False` skips the cross-check against
    transformers' save_pretrained mapping (for models that are not transformers models).
    """

    def __init__(self, model: torch.nn.Module, policy: DtypePolicy | None = None, *,
                 rank: int | None = None, source_rank: int = 0,
                 check_names: bool = True) -> None:
        self.model = model
        self.policy = policy or DtypePolicy()
        if rank is None:
            rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        self.rank, self.source_rank = rank, source_rank
        self.entries: list[Entry] = model_entries(model, check=check_names)
        self._specs: list[TensorSpec] = []
        self._where: dict[str, tuple[int, int]] = {}  # checkpoint name -> (entry, piece)
        for i, entry in enumerate(self.entries):
            dtype = _lookup(model, entry.key).dtype
            for j, (name, shape) in enumerate(zip(entry.names, entry.shapes, strict=True)):
                self._specs.append(TensorSpec(name, shape, self.policy.dtype_for(name, dtype),
                                              source_rank))
                self._where[name] = (i, j)

    @property
    def is_source(self) -> bool:
        return self.rank == self.source_rank

    def plan_specs(self) -> list[TensorSpec]:
        """Every checkpoint tensor; computed at construction from metadata, no collective."""
        return list(self._specs)

    def iter_tensors(self, plan: RefitPlan) -> Iterator[tuple[str, torch.Tensor | None]]:
        """(name, full tensor in the declared dtype) per plan spec, in plan order.

        Runs the gathers on every rank; yields None off the source rank. A fused expert group
        that is contiguous in the plan (as plan_specs lists it) is gathered once.
        """
        reshard_fsdp(self.model)
        cached: tuple[int, list[torch.Tensor]] | None = None
        for spec in plan.specs:
            where = self._where.get(spec.name)
            if where is None:
                raise KeyError(f"plan tensor {spec.name!r} is not a tensor of this model")
            i, j = where
            entry = self.entries[i]
            tensor: torch.Tensor | None
            if entry.kind == "plain":
                cached = None
                raw = _lookup(self.model, entry.key)
                if isinstance(raw, DTensor):
                    tensor = _full(raw)  # a collective: every rank runs it
                    if not self.is_source:
                        tensor = None  # gathered for the collective only: free it now
                else:
                    tensor = raw.detach() if self.is_source else None
            else:
                if cached is None or cached[0] != i:
                    cached = None  # drop the previous fused tensor before gathering the next
                    full = _full(_lookup(self.model, entry.key))
                    cached = (i, list(split_experts(entry.kind, full)) if self.is_source else [])
                    del full
                tensor = cached[1][j] if self.is_source else None
            if tensor is not None and tensor.dtype != spec.dtype:
                tensor = tensor.to(spec.dtype)
            yield spec.name, tensor
            del tensor
        cached = None
