"""The cost model's arithmetic: cut a tensor list into the broadcaster's buckets, then time a
refit as a critical path through its stages with N rotating buffers.

Per bucket, in plan order: its sender takes it (gather and checks: host work per tensor and
per bucket, `fit_host`) without waiting for a buffer, then waits for the buffer (its bucket
`buffers` back has left the wire) and packs into it: on a GPU the pack runs on the device while
the host takes the next bucket (`StageCosts.overlap`), on a CPU the host packs before going on;
a host that waits for its one buffer starts the next pack a hand-back after the buffer is free
(`handback_s` a bucket plus `handback_tensor_s` a tensor of it: on a GPU the pack's own host
calls, as measured; on a CPU fitted). Frames sent by CUDA graph replay (`one_stream`): the host
never waits for a buffer (the stream orders the reuse) and a bucket's pack starts once its
sender's previous broadcast ended; the device costs then carry the replay's own (per frame, per
launch). The
wire carries the buckets one collective at a time over the group; a receiver holds `buffers`
buckets, so the wire waits for the apply of the bucket `buffers` back.

Concurrent sources (`concurrent`): every source's buckets form a stream of its own, timed by
`simulate` alone (its own buffers, its own wire); the streams share the nodes' links, each
given as the seconds its busiest link needs for all the bytes crossing it; the refit ends with
the slowest of the two. `place_stage` gives a Megatron stage's candidate sources, `spread`
places tensors over them by bytes, `imbalance` says how well.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Bucket:
    sender: int
    tensors: int
    nbytes: int
    expert_bytes: int = 0


@dataclass(frozen=True)
class StageCosts:
    """Per-bucket stage times (seconds), each list in bucket order."""

    host: list[float]  # the take: gather and checks
    device: list[float]  # the pack into the buffer
    wire: list[float]
    apply: list[float]
    overlap: bool = True  # the pack runs on the device while the host goes on (a GPU)
    one_stream: bool = False  # frames by graph replay: pack and broadcast on one stream


@dataclass
class Timeline:
    seconds: float
    totals: dict[str, float] = field(default_factory=dict)  # the critical path, by stage
    detail: dict[str, float] = field(default_factory=dict)  # concurrent: the slowest stream's

    @property
    def bound(self) -> str:
        """The stage whose own total comes closest to the whole refit's time."""
        return max(self.totals, key=self.totals.get)


def cut(items: list[tuple[int, int, bool]], bucket_bytes: int) -> list[Bucket]:
    """(sender, nbytes, is_expert) per tensor, in plan order -> buckets: a run of one sender's
    tensors is cut when the next would overflow `bucket_bytes`; a larger tensor goes alone."""
    out: list[Bucket] = []
    sender, count, size, expert = -1, 0, 0, 0
    for s, n, ex in items:
        if count and (s != sender or size + n > bucket_bytes):
            out.append(Bucket(sender, count, size, expert))
            count, size, expert = 0, 0, 0
        sender, count, size, expert = s, count + 1, size + n, expert + (n if ex else 0)
    if count:
        out.append(Bucket(sender, count, size, expert))
    return out


def interleave(buckets: list[Bucket]) -> list[Bucket]:
    """The buckets taken one sender at a time in turn (each sender's own order kept), so a
    sender produces its next bucket while the others' go over the wire."""
    queues: dict[int, list[Bucket]] = {}
    for b in buckets:
        queues.setdefault(b.sender, []).append(b)
    out, turn = [], [q[::-1] for q in queues.values()]
    while turn:
        out += [q.pop() for q in turn]
        turn = [q for q in turn if q]
    return out


def fit_host(lists: list[tuple[float, float, float]]) -> tuple[float, float]:
    """(tensors, buckets, host seconds) of one sender's refit of each list -> its host seconds
    per tensor and per bucket: the least-squares fit. Lists that cannot tell the two apart
    (one list, or a negative solution) give it all to the tensors and none to the buckets."""
    if len(lists) >= 2:
        a = [[t, b] for t, b, _ in lists]
        y = [h for _, _, h in lists]
        per_tensor, per_bucket = _least_squares(a, y)
        if per_tensor >= 0 and per_bucket >= 0:
            return per_tensor, per_bucket
    return sum(h for *_, h in lists) / sum(t for t, *_ in lists), 0.0


def _least_squares(a: list[list[float]], y: list[float]) -> tuple[float, float]:
    """The two unknowns x minimising |a x - y| (the normal equations, solved by hand)."""
    s11 = sum(r[0] * r[0] for r in a)
    s12 = sum(r[0] * r[1] for r in a)
    s22 = sum(r[1] * r[1] for r in a)
    t1 = sum(r[0] * v for r, v in zip(a, y, strict=True))
    t2 = sum(r[1] * v for r, v in zip(a, y, strict=True))
    det = s11 * s22 - s12 * s12
    if det == 0:
        return -1.0, -1.0
    return (t1 * s22 - t2 * s12) / det, (s11 * t2 - s12 * t1) / det


def simulate(buckets: list[Bucket], costs: StageCosts, buffers: int,
             handback_s: float = 0.0, handback_tensor_s: float = 0.0) -> Timeline:
    """The refit's end: when the last bucket is applied (see the module's doc). `totals`
    splits that time along the critical path: the wire busy, the wire waiting on a sender,
    the wire waiting on a receiver's buffer plus the last apply."""
    sent: dict[int, list[float]] = {}  # sender -> wire end of each of its buckets
    host_free: dict[int, float] = {}  # sender -> when its host may take the next bucket
    packed: dict[int, float] = {}  # sender -> when its last pack ended
    applied: list[float] = []
    wire_end, totals = 0.0, {"sender": 0.0, "wire": 0.0, "apply": 0.0}
    for i, b in enumerate(buckets):
        mine = sent.setdefault(b.sender, [])
        # a host that waits for its one buffer wakes the hand-back after the buffer is free
        handback = handback_s + b.tensors * handback_tensor_s if buffers == 1 else 0.0
        free = mine[-buffers] + handback if len(mine) >= buffers else 0.0
        if costs.one_stream:  # the stream waits, not the host: after the previous broadcast
            free, after = 0.0, mine[-1] if mine else 0.0
        else:
            after = packed.get(b.sender, 0.0)
        taken = host_free.get(b.sender, 0.0) + costs.host[i]
        launch = max(taken, free)
        packed[b.sender] = max(launch, after) + costs.device[i]
        host_free[b.sender] = launch if costs.overlap else packed[b.sender]
        held = applied[i - buffers] if i >= buffers else 0.0
        start = max(packed[b.sender], wire_end, held)
        totals["sender" if packed[b.sender] >= held else "apply"] += start - wire_end
        wire_end = start + costs.wire[i]
        totals["wire"] += costs.wire[i]
        mine.append(wire_end)
        applied.append(max(wire_end, applied[-1] if applied else 0.0) + costs.apply[i])
    if applied:
        totals["apply"] += applied[-1] - wire_end
    return Timeline(applied[-1] if applied else 0.0, totals)


def concurrent(streams: list[tuple[list[Bucket], StageCosts]], shared: dict[str, float],
               buffers: int) -> Timeline:
    """Streams that run at once, each through its own `buffers` (`simulate`), and the links
    they share (`shared`: stage -> seconds its busiest link needs for all its bytes) -> the
    refit's end, the slowest of the slowest stream ("source") and the shared stages. `totals`
    holds each of them (bounds, not a split of one path); `detail` the slowest stream's split.
    Where two are near equal the end is later than their max: the shared links are taken to
    run at their full rate while the streams' bursts interleave."""
    runs = [simulate(b, c, buffers) for b, c in streams]
    slowest = max(runs, key=lambda r: r.seconds, default=Timeline(0.0))
    totals = {"source": slowest.seconds, **shared}
    return Timeline(max(totals.values()), totals, dict(slowest.totals))


def spread(loads: dict[int, float], items: list[tuple[float, Sequence[int]]]) -> list[int]:
    """Items (size, the ranks that may send it) placed largest first, each on its candidate
    with the least load so far (ties: the lower rank), as `common.plan.balance_sources` does;
    `loads` (what each rank sends already) grows -> each item's rank, in the items' order."""
    out = [0] * len(items)
    for i in sorted(range(len(items)), key=lambda i: -items[i][0]):
        size, ranks = items[i]
        out[i] = min(sorted(ranks), key=lambda r: loads.get(r, 0))
        loads[out[i]] = loads.get(out[i], 0) + size
    return out


def place_stage(tp: int, dp: int, ep: int, etp: int,
                experts: bool) -> tuple[tuple[tuple[int, ...], ...], tuple[int, ...]]:
    """One Megatron pipeline stage's candidate sources as `mcore_refit/placement.py` places
    them (`sources="spread"`), in ranks local to the stage (TP groups: runs of `tp`; the
    expert grid: ETP, then EP, then EDP) -> (the owners of each EP rank, one per EDP replica,
    any of which may send its experts: expert-TP rank 0 of its ETP group in that replica; the
    ranks that may send a dense tensor: every rank of the stage, its DP / EP replicas holding
    it alike). On this grid every EP rank has exactly one owner per replica, so the library's
    fallback (the whole stage from its first rank) never applies. Sources may share gathers:
    `gather_group`."""
    replicas = range(tp * dp // (etp * ep))
    owners = tuple(tuple(etp * (r * ep + e) for r in replicas) for e in range(ep))
    return owners if experts else (), tuple(range(tp * dp))


def gather_group(rank: int, size: int) -> range:
    """The ranks that run the all-gather of a tensor `rank` sends, split `size` ways: a dense
    tensor's over the sender's TP group, an expert's over its owner's ETP group (runs of
    `size` ranks, in a stage whose first rank is a multiple of `size`)."""
    first = rank // size * size
    return range(first, first + size)


def imbalance(values: Sequence[float]) -> float:
    """The largest over the mean (1.0: all equal, or none)."""
    mean = sum(values) / len(values) if values else 0.0
    return max(values) / mean if mean else 1.0
