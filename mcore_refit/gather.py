"""Collectives that rebuild full Megatron tensors from their TP / ETP / EP pieces."""

from __future__ import annotations

import torch
import torch.distributed as dist


def gather_partitioned(
    local: torch.Tensor, group: dist.ProcessGroup | None, dim: int, stride: int
) -> torch.Tensor:
    """All-gather a tensor split along `dim` over `group`, honouring `partition_stride`.

    With stride s each rank holds s blocks (e.g. gated fc1: `[gate_r; up_r]`); the full tensor
    is block 0 of every rank, then block 1 of every rank, ... (i.e. `[gate; up]`), not the
    plain concat of shards.
    """
    world = dist.get_world_size(group) if group is not None else 1
    if world == 1:
        return local
    local = local.detach().contiguous()
    parts = [torch.empty_like(local) for _ in range(world)]
    dist.all_gather(parts, local, group=group)
    if stride == 1:
        return torch.cat(parts, dim)
    blocks = [p.chunk(stride, dim) for p in parts]
    return torch.cat([b[k] for k in range(stride) for b in blocks], dim)


def gather_experts(full: torch.Tensor, group: dist.ProcessGroup | None) -> list[torch.Tensor]:
    """All-gather one local expert slot over the EP group: item e is EP rank e's expert."""
    world = dist.get_world_size(group) if group is not None else 1
    if world == 1:
        return [full]
    full = full.detach().contiguous()
    parts = [torch.empty_like(full) for _ in range(world)]
    dist.all_gather(parts, full, group=group)
    return parts
