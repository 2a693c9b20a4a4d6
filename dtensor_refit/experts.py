"""Expert owners as sources: each per-expert checkpoint tensor is sent by a rank that holds it.

Gathering a fused expert tensor whole (`full_tensor()`) moves every expert to every rank of its
mesh, only for one rank to send it. The expert dim (dim 0) is split over the EP mesh dims (and
over FSDP2's dim when it shards dim 0 too), so a rank already holds its experts whole, or does
after a gather over the dims that split an expert (FSDP2's `Shard(1)`), among its own EP group.

Everything is computed at setup from the DTensor's placements and mesh, with no collective, the
same on every rank: the global expert ids each mesh coordinate holds come from splitting an
index over the expert dim the way the placements split the tensor, in mesh-dim order (DTensor's
own `_split_tensor`, so `_StridedShard` means what it means to DTensor), checked against this
rank's local shape and for covering every expert exactly once. The first replica (coordinate 0
on replicated dims) sends; inside a gather group the experts are dealt out in contiguous blocks,
so buckets stay long. Anything not understood returns the reason, and the caller gathers as
before.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement, _StridedShard

from dtensor_refit.names import Entry, split_experts

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Owners:
    """Where each expert of one fused tensor is sent from, and what this rank does for it.

    `sources[e]` is the default-group rank sending expert e; `local[e]` its row in this rank's
    local tensor (after `gather_to`), for the experts this rank sends; `gather_to` the
    placements this rank redistributes to first (None: no gather here, the local shard is used
    as is, or this rank sends nothing and gathers nothing).
    """

    sources: tuple[int, ...]
    local: dict[int, int]
    gather_to: tuple[Placement, ...] | None

    def rows(self, tensor: DTensor) -> torch.Tensor | None:
        """This rank's experts whole (rows as in `local`), or None when it sends none."""
        from torch.distributed._functional_collectives import AsyncCollectiveTensor

        if self.gather_to is not None:
            with torch.no_grad():  # a gather among this rank's EP group only
                out = tensor.redistribute(tensor.device_mesh, self.gather_to).to_local()
            return out.wait() if isinstance(out, AsyncCollectiveTensor) else out
        return tensor.to_local().detach() if self.local else None


def _is_shard(p: Placement) -> bool:
    return isinstance(p, (Shard, _StridedShard))


def _expert_ids(placements: Sequence[Placement], mesh_shape: Sequence[int], experts: int,
                coord: Sequence[int]) -> tuple[int, ...]:
    """The global expert ids the mesh coordinate `coord` holds, in local row order."""
    index = torch.arange(experts)
    for d, p in enumerate(placements):
        if _is_shard(p) and p.dim == 0:
            chunks, _ = p._split_tensor(index, mesh_shape[d], with_padding=False)
            index = chunks[coord[d]]
    return tuple(int(i) for i in index.tolist())


def _classify(tensor: DTensor) -> tuple[list[int], list[int], list[int]] | str | None:
    """(expert dims, gather dims, replica dims) of the mesh, why the layout is not known, or
    None when no mesh dim splits the experts (nothing to own: the tensor is gathered)."""
    from torch.distributed.tensor._dtensor_spec import DTensorSpec

    placements = tensor.placements
    order = getattr(tensor._spec, "shard_order", None)
    if order is not None and order != DTensorSpec.compute_default_shard_order(placements):
        return f"an explicit shard order {order}"
    split, gather, replica = [], [], []
    for d, p in enumerate(placements):
        if p.is_replicate():
            replica.append(d)
        elif _is_shard(p):
            (split if p.dim == 0 else gather).append(d)
        else:
            return f"placement {p} on mesh dim {d}"
    return (split, gather, replica) if split else None


def plan_owners(tensor: DTensor, rank: int) -> Owners | str | None:
    """The owners of a fused expert tensor [E, ...] for default-group rank `rank`; a reason
    when the layout is not understood; None when its experts are not split over ranks."""
    kinds = _classify(tensor)
    if kinds is None or isinstance(kinds, str):
        return kinds
    _, gather, replica = kinds
    mesh, placements, experts = tensor.device_mesh, tensor.placements, tensor.shape[0]
    shape, ranks = tuple(mesh.mesh.shape), mesh.mesh
    sources: dict[int, int] = {}
    ids_of: dict[tuple[int, ...], tuple[int, ...]] = {}
    for coord in itertools.product(*(range(n) for n in shape)):
        ids_of[coord] = ids = _expert_ids(placements, shape, experts, coord)
        if any(coord[d] for d in replica):
            continue  # the first replica sends
        members = list(itertools.product(*(range(shape[d]) for d in gather)))
        me = members.index(tuple(coord[d] for d in gather))
        for k, e in enumerate(ids):
            if k * len(members) // len(ids) == me:  # contiguous blocks per group member
                if e in sources:
                    return f"expert {e} is held by two ranks of one replica"
                sources[e] = int(ranks[coord])
    if sorted(sources) != list(range(experts)):
        return f"the placements do not cover experts {sorted(set(range(experts)) - set(sources))}"
    mine = mesh.get_coordinate()
    if mine is None:
        return Owners(tuple(sources[e] for e in range(experts)), {}, None)
    local_rows = tensor.to_local().shape[0]
    if len(ids_of[tuple(mine)]) != local_rows:
        return (f"this rank holds {local_rows} experts, the placements say "
                f"{len(ids_of[tuple(mine)])}")
    local = {e: k for k, e in enumerate(ids_of[tuple(mine)]) if sources[e] == rank}
    runs = bool(gather) and not any(mine[d] for d in replica)
    gather_to = tuple(Replicate() if d in gather else p for d, p in enumerate(placements))
    return Owners(tuple(sources[e] for e in range(experts)), local,
                  gather_to if runs else None)


def own_pieces(kind: str, owners: Owners, rows: torch.Tensor | None) -> dict[int, torch.Tensor]:
    """Per-expert tensors this rank sends, keyed by their index in the entry's names."""
    per = 2 if kind == "gate_up" else 1  # gate_proj, up_proj per expert, or down_proj
    out: dict[int, torch.Tensor] = {}
    for e, k in owners.local.items():
        assert rows is not None
        for t, piece in enumerate(split_experts(kind, rows[k : k + 1])):
            out[per * e + t] = piece
    return out


def name_sources(kind: str, owners: Owners) -> list[int]:
    """The source rank of each of the entry's names (in `Entry.names` order)."""
    per = 2 if kind == "gate_up" else 1
    return [s for s in owners.sources for _ in range(per)]


def for_entry(entry: Entry, raw: torch.Tensor, rank: int) -> Owners | None:
    """Owners of a fused expert entry's tensor, or None (then it is gathered to one source:
    a tensor whose experts no rank splits, or, with a warning, a layout not understood)."""
    import torch.distributed as dist

    if entry.kind == "plain" or not isinstance(raw, DTensor):
        return None
    if rank != dist.get_rank():
        why: str | Owners | None = f"refit rank {rank} is not default-group rank " \
                                   f"{dist.get_rank()}"
    else:
        try:
            why = plan_owners(raw, rank)
        except Exception as e:  # noqa: BLE001 - a layout this torch does not split so
            why = f"{type(e).__name__}: {e}"
    if why is None or isinstance(why, Owners):
        return why
    log.warning("%s %s: expert owners as sources not used (%s); gathered instead",
                entry.key, raw.placements, why)
    return None
