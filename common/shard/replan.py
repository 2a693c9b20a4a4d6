"""The re-plan at each refit's start: who needs what, agreed by every rank of the group.

Every rank's needs digest is all-gathered (one small exchange per refit; trainers and workers
without a learned map say ""). When the digests differ from the last refit's, each distinct
report is broadcast once (by its first rank), checked against the plan on every rank (a report
that does not fit is refused, naming the worker, and the refit fails before a byte is sent),
need-sets are formed (`common.shard.plan`) and each set gets a subgroup: every trainer + its
workers, built in set order by its members alone. Until a worker reports needs it takes whole
buckets (the full set); with no compact set at all the whole group carries whole buckets, as
without shard-to-shard. Switched off (`RefitConfig.shard_to_shard`) or on a transport without
subgroups, nothing is exchanged. With concurrent sources (`common.transfer.schedule`) each
set's subgroup is one per source: that source + the set's workers (without need-sets: the
source + every worker, built at the first refit).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from common.errors import NOTHING_LOADED, NeedsRefusedError
from common.plan import Bucket, RefitPlan
from common.shard.needs import Needs
from common.shard.plan import COMPACT, FULL, Gather, NeedSet, ShardPlan
from common.wire.transport import Subgroup, Transport

log = logging.getLogger(__name__)
DIGEST_BYTES = 64
_FULL = Needs({}, full=True)


@dataclass(frozen=True)
class Route:
    """One frame of a bucket: to need-set `set_index` (-1: the whole group) over `sub`
    (None: the whole group), the whole bucket (`gather` None) or its compact bytes."""

    set_index: int
    sub: Subgroup | None
    gather: Gather | None = None

    @property
    def kind(self) -> int:
        return FULL if self.gather is None else COMPACT

    def payload_bytes(self, bucket: Bucket) -> int:
        return bucket.nbytes if self.gather is None else self.gather.nbytes


WHOLE_GROUP = Route(-1, None)


class Sharding:
    """One rank's view of the group's need-sets and its subgroups, kept across refits."""

    def __init__(self, group: Transport, plan: RefitPlan, schedule) -> None:
        """`schedule`: the plan's `common.transfer.schedule.Schedule` (concurrent sources:
        each set's frames go per source, over a subgroup of that source and the set)."""
        self.group, self.plan, self.schedule = group, plan, schedule
        self.enabled = plan.config.shard_to_shard and group.supports_subgroups
        self.digests: list[str] | None = None
        self.shard: ShardPlan | None = None  # None: whole buckets to the whole group
        # (set index, source rank; -1: every trainer) -> its subgroup, built by its members
        self.subgroups: dict[tuple[int, int], Subgroup | None] = {}
        self.replans = 0

    def agree(self, mine: Needs | None, what: str = "refit") -> None:
        """Every rank, at a refit's start (`what`, e.g. "refit v3", names it in errors): this
        rank's needs (None: whole buckets)."""
        if not self.enabled:
            if self.schedule.concurrent and not self.subgroups:
                self._build_subgroups([(-1, tuple(range(self.group.num_trainers,
                                                        self.group.world_size)))])
            return
        group = self.group
        digest = "" if mine is None or mine.full else mine.digest
        raw = group.all_gather_bytes(digest.encode(), DIGEST_BYTES, f"{what} needs digests")
        digests = [d.decode() for d in raw]
        if digests == self.digests:
            return
        self.digests = None  # until this re-plan succeeds
        needs = self._reports(digests, mine, what)
        self.shard, self.subgroups = None, {}
        group.drop_subgroups()
        if any(not n.full for n in needs.values()):
            self.shard = ShardPlan(self.plan, needs)
            self._build_subgroups([(s.index, s.ranks) for s in self.shard.sets])
        elif self.schedule.concurrent:
            self._build_subgroups([(-1, tuple(range(group.num_trainers, group.world_size)))])
        self.digests, self.replans = digests, self.replans + 1
        if group.rank == 0:
            log.info("%s: re-planned need-sets: %s", group.label,
                     self.shard.describe() if self.shard else "every worker takes whole buckets")

    def _build_subgroups(self, sets: list[tuple[int, tuple[int, ...]]]) -> None:
        """Each set's subgroup (every trainer + the set), or with concurrent sources one per
        set and source (that source + the set), built by their members in one order of keys
        on every rank: (set, source) ascending."""
        group = self.group
        sources = self.schedule.sources if self.schedule.concurrent else (-1,)
        for index, ranks in sets:
            for src in sources:
                trainers = list(range(group.num_trainers)) if src < 0 else [src]
                if group.rank in trainers or group.rank in ranks:
                    key = f"{group.refits}/{index}" + (f"/{src}" if src >= 0 else "")
                    self.subgroups[index, src] = group.subgroup(trainers + list(ranks), key)

    def set_indices(self) -> set[int]:
        """The need-sets this rank takes part in."""
        return {index for index, _ in self.subgroups}

    def _reports(self, digests: list[str], mine: Needs | None,
                 what: str) -> dict[int, Needs]:
        """Every receiver's needs: each distinct report broadcast by its first rank, checked
        against the plan on every rank (the same verdict everywhere)."""
        group, sizes = self.group, [b.nbytes for b in self.plan.buckets]
        out: dict[int, Needs] = {}
        seen: dict[str, Needs] = {}
        whys: dict[str, str | None] = {}  # digest -> why its report is refused
        refused = []
        for rank in range(group.num_trainers, group.world_size):
            digest = digests[rank]
            if not digest:
                out[rank] = _FULL
                continue
            if digest not in seen:
                text = group.broadcast_bytes(mine.to_json().encode() if rank == group.rank
                                             else None, rank, f"{what} needs of rank {rank}")
                seen[digest] = Needs.from_json(text.decode())
                whys[digest] = seen[digest].problem(sizes) or (
                    "its report does not match its digest" if seen[digest].digest != digest
                    else None)
            if whys[digest] is not None:
                refused.append(rank)
            out[rank] = seen[digest]
        if refused:
            lines = "; ".join(f"refit rank {r}{_who(group, r)}: {whys[digests[r]]}"
                              for r in refused)
            raise NeedsRefusedError(f"{group.label}: the re-plan refused need reports that do "
                                    f"not fit plan {self.plan.digest[:12]}: {lines}; "
                                    f"{NOTHING_LOADED}", tuple(refused))
        return out

    def routes(self, bucket: Bucket) -> list[Route]:
        """The frames of `bucket` this rank takes part in, in the order every rank sends
        them: a trainer all of them (with concurrent sources: all of the buckets it sources,
        none of the others'), a worker its set's (none if it reads nothing of it)."""
        src = bucket.source_rank if self.schedule.concurrent else -1
        if self.shard is None:
            if not self.schedule.concurrent:
                return [WHOLE_GROUP]
            key = (-1, src)
            return [Route(-1, self.subgroups[key])] if key in self.subgroups else []
        out = []
        for s in self.shard.sets:
            if (key := (s.index, src)) not in self.subgroups:
                continue
            if s.full:
                out.append(Route(s.index, self.subgroups[key]))
            elif gather := self.shard.frames[s.index].get(bucket.index):
                out.append(Route(s.index, self.subgroups[key], gather))
        return out

    def worker_bytes(self) -> dict[int, int]:
        """Receiving rank -> the payload bytes a refit sends it (whole buckets, or its set's
        compact frames)."""
        whole = sum(b.nbytes for b in self.plan.buckets)
        ranks = range(self.group.num_trainers, self.group.world_size)
        if self.shard is None:
            return dict.fromkeys(ranks, whole)
        per_set = {s.index: whole if s.full else sum(g.nbytes for g in
                                                      self.shard.frames[s.index].values())
                   for s in self.shard.sets}
        return {r: per_set[self.shard.set_of(r).index] for r in ranks}

    def my_set(self) -> NeedSet | None:
        """This receiver's need-set, or None when the whole group takes whole buckets."""
        return None if self.shard is None else self.shard.set_of(self.group.rank)


def _who(group: Transport, rank: int) -> str:
    name = group.rank_names.get(rank)
    return f" ({name})" if name else ""
