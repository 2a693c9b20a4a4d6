"""Which training ranks may send a pipeline stage's tensors (`MegatronWeightSource`'s
`sources="spread"`): several per stage, so the concurrent sources of `common.transfer.schedule`
share the sending.

An expert is sent by the rank that owns it: its EP rank in expert-data-parallel replica 0,
expert-TP rank 0 (which holds the full expert after the expert-TP all-gather). A dense tensor
may be sent by any rank of the stage: DP / CP / EP replicas hold it alike, and the TP
all-gather (`mcore_refit.gather.gather_partitioned`) leaves the full tensor on every rank of the
TP group that runs it, so only the chosen rank's TP group gathers it. Sources may share gathers
(a TP group with several sources, an owner that takes part in another source's TP gather):
every trainer runs its gathers and issues its sends in plan order (the schedule's order rule),
so no source can wait on one that waits on it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch.distributed as dist


class RankInfo(NamedTuple):
    """One rank of a stage as the placement sees it (exchanged over the stage's ranks)."""

    rank: int
    ep_rank: int
    etp_rank: int
    edp_rank: int  # its expert-data-parallel rank (0: the replica whose experts are sent)


@dataclass(frozen=True)
class StagePlacement:
    """A stage's candidate sources. `owners` None: the whole stage from `first` (experts
    gathered over EP onto it, `sources="stage"`); else `owners[e]` sends EP rank e's experts
    and any of `dense` a dense tensor."""

    first: int
    owners: tuple[int, ...] | None = None
    dense: tuple[int, ...] = ()

    @property
    def spread(self) -> bool:
        return self.owners is not None

    def candidates(self, expert_member: int | None) -> tuple[int, ...]:
        """The ranks that may send a tensor: an expert's (`expert_member`: its EP rank) or,
        with None, a dense tensor's."""
        if not self.spread:
            return (self.first,)
        return (self.owners[expert_member],) if expert_member is not None else self.dense


def group_ranks(group: dist.ProcessGroup | None) -> tuple[int, ...]:
    return tuple(dist.get_process_group_ranks(group)) if group is not None else (dist.get_rank(),)


def stage_infos(stage_group: dist.ProcessGroup) -> list[RankInfo]:
    """Every rank of this stage's `RankInfo` (one `all_gather_object` over the stage)."""
    from megatron.core import parallel_state as ps

    mine = RankInfo(dist.get_rank(), ps.get_expert_model_parallel_rank(),
                    ps.get_expert_tensor_parallel_rank(), ps.get_expert_data_parallel_rank())
    out: list = [None] * dist.get_world_size(stage_group)
    dist.all_gather_object(out, mine, group=stage_group)
    return out


def place_stage(infos: Sequence[RankInfo], experts: bool) -> StagePlacement:
    """The stage's candidate sources (see the module doc); `experts`: it holds experts. A
    layout whose owners are not one rank per EP rank is sent as `"stage"` would."""
    infos = sorted(infos)
    first = infos[0].rank
    owners = {i.ep_rank: i.rank for i in infos if i.edp_rank == 0 and i.etp_rank == 0}
    if experts and (not owners or sorted(owners) != list(range(len(owners)))):
        return StagePlacement(first)
    order = tuple(owners[e] for e in sorted(owners)) if experts else ()
    return StagePlacement(first, order, tuple(i.rank for i in infos))
