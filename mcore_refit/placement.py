"""Which training ranks may send a pipeline stage's tensors (`MegatronWeightSource`'s
`sources="spread"`): several per stage, so the concurrent sources of `common.transfer.schedule`
share the sending.

An expert is sent by an owner of it: expert-TP rank 0 of its EP rank's expert-TP group (which
holds the full expert after that group's all-gather) in any expert-data-parallel (EDP) replica,
since every replica holds the same experts. Its candidates are its EP rank's owners, one per
replica, and `common.plan.balance_sources` picks one by bytes with the dense tensors, as for
those (every rank the same); only the chosen replica's expert-TP group gathers it. A dense
tensor may be sent by any rank of the stage: DP / CP / EP replicas hold it alike, and the TP
all-gather (`mcore_refit.gather.gather_partitioned`) leaves the full tensor on every rank of the
TP group that runs it, so only the chosen rank's TP group gathers it. Whether a group gathers
is a function of the plan alone, the same on each of its ranks (they share the EP and EDP rank,
or the TP group). Sources may share gathers (a TP group with several sources, an owner that
takes part in another source's TP gather): every trainer runs its gathers and issues its sends
in plan order (the schedule's order rule), so no source can wait on one that waits on it.
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
    edp_rank: int  # its expert-data-parallel rank: the replica of the experts it holds


@dataclass(frozen=True)
class StagePlacement:
    """A stage's candidate sources. `owners` None: the whole stage from `first` (experts
    gathered over EP onto it, `sources="stage"`); else `owners[e][r]` is EP rank e's owner in
    EDP replica r (any of them may send its experts) and any of `dense` a dense tensor."""

    first: int
    owners: tuple[tuple[int, ...], ...] | None = None
    dense: tuple[int, ...] = ()

    @property
    def spread(self) -> bool:
        return self.owners is not None

    def candidates(self, expert_member: int | None) -> tuple[int, ...]:
        """The ranks that may send a tensor: an expert's (`expert_member`: its EP rank) or,
        with None, a dense tensor's."""
        if not self.spread:
            return (self.first,)
        return self.owners[expert_member] if expert_member is not None else self.dense


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
    layout whose owners are not one rank per EP rank and EDP replica (EP ranks 0..E-1 in
    replicas 0..R-1) is sent as `"stage"` would."""
    infos = sorted(infos)
    first = infos[0].rank
    if not experts:
        return StagePlacement(first, (), tuple(i.rank for i in infos))
    owners = {(i.edp_rank, i.ep_rank): i.rank for i in infos if i.etp_rank == 0}
    eps = 1 + max((e for _, e in owners), default=-1)
    replicas = 1 + max((r for r, _ in owners), default=-1)
    if not owners or len(owners) != eps * replicas:
        return StagePlacement(first)
    return StagePlacement(first, tuple(tuple(owners[r, e] for r in range(replicas))
                                       for e in range(eps)), tuple(i.rank for i in infos))
