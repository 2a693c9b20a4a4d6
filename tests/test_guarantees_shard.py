"""Guarantees of shard-to-shard (need reports, need-sets, compact frames), of the verdict and of
the refit store's address, each held by a test that fails when the guarantee breaks
(`pytest -k guarantee`; the others are in tests/test_guarantees.py). Real gloo groups,
ranks started by `run_ranks`, no engine."""

from __future__ import annotations

import time

import numpy as np
import psutil
import torch

from common.errors import RefitError
from common.plan import RefitPlan
from common.shard.needs import ByteRanges, Needs
from common.source import DictWeightSource
from common.transfer.sender import RefitReceiver, RefitSender
from common.wire.group import RefitGroup, free_port
from recipes.rank_runner import run_ranks
from tests.multiproc import expect_ok, outcome
from tests.test_failures import (
    TRAINERS,
    CorruptingReceiver,
    check_corrupted,
    corrupted_rank,
    join,
    tensors,
)
from tests.test_shard_core import CONFIG, bucket_image, needs_for, split_tensors

HOST = "127.0.0.1"


def plan_of(version: int) -> RefitPlan:
    return RefitPlan.build(DictWeightSource(split_tensors(version)).plan_specs(), CONFIG)


def report(plan: RefitPlan, what: int | str) -> Needs:
    """Half `what` (0 or 1) of every tensor (`needs_for`); "before": half 0, with bucket 1's
    first range starting 8 bytes before the bucket."""
    if what != "before":
        return needs_for(plan, what)
    needs = needs_for(plan, 0)
    ranges = needs.buckets[1]
    return Needs({**needs.buckets, 1: ByteRanges.of(np.append(ranges.starts, -8),
                                                      np.append(ranges.lengths, 16))})


def refusal(fn) -> tuple[str, str, list[int]]:
    """("ok", "", []) or the refit error's type, message and refused ranks."""
    try:
        fn()
    except RefitError as e:
        return type(e).__name__, str(e), list(getattr(e, "ranks", ()))
    return "ok", "", []


class Landed:
    """One refit's frames at a receiver: each compact one checked, byte for byte, against
    the needs the receiver reports now (`wrong`: the buckets whose bytes are not those)."""

    def __init__(self, receiver: RefitReceiver, want: dict[str, torch.Tensor]) -> None:
        self.receiver, self.want = receiver, want
        self.frames, self.whole, self.wrong = 0, 0, []

    def whole_bucket(self, items: list) -> None:
        self.whole += 1

    def compact(self, index: int, payload: torch.Tensor) -> None:
        self.frames += 1
        ranges = self.receiver.needs.buckets[index]
        image, got = bucket_image(self.receiver.plan, index, self.want), payload.numpy()
        for place, start, length in zip(ranges.placed(), ranges.starts, ranges.lengths,
                                        strict=True):
            if not np.array_equal(got[place : place + length], image[start : start + length]):
                self.wrong.append(index)
                return


def needs_rank(rank: int, world: int, port: int, rounds: list[list]) -> list[dict]:
    """One trainer; refit v(i + 1) with receiver r reporting `report(plan, rounds[i][r - 1])`."""
    group = RefitGroup(host=HOST, port=port, rank=rank, world_size=world, device="cpu",
                       num_trainers=1, timeout_s=CONFIG.timeout_s)
    if group.is_trainer:
        sender = RefitSender.setup(group, plan_of(1))
        return [{"outcome": refusal(lambda v=v: sender.refit(
            DictWeightSource(split_tensors(v)), v)), "replans": sender.sharding.replans}
                for v in range(1, len(rounds) + 1)]
    receiver, out = RefitReceiver.setup(group), []
    for version, reports in enumerate(rounds, 1):
        receiver.needs = report(receiver.plan, reports[rank - 1])
        landed = Landed(receiver, split_tensors(version))
        seen = refusal(lambda v=version, landed=landed: receiver.receive(
            landed.whole_bucket, on_compact=landed.compact, version=v))
        out.append({"outcome": seen, "frames": landed.frames, "whole": landed.whole,
                    "wrong": landed.wrong})
    return out


def test_guarantee_a_need_report_starting_before_its_bucket_is_refused_naming_the_worker():
    """A report whose range of bucket 1 starts 8 bytes before the bucket (its end inside it)
    fails the refit on every rank before a byte is sent, naming the worker (rank 2)."""
    res = expect_ok(run_ranks(needs_rank, 3, [[0, "before"]]))
    for rank, (got,) in res.items():
        kind, msg, ranks = got["outcome"]
        assert kind == "NeedsRefusedError" and ranks == [2], \
            f"rank {rank}: a need report starting before its bucket was not refused: {got}"
        assert "refit rank 2" in msg and "bucket 1: bytes -8.." in msg, msg
        assert "nothing of it was loaded" in msg, msg
        assert rank == 0 or got["frames"] == got["whole"] == 0, got  # nothing was sent


def check_replanned(res: dict, rounds: list[list]) -> None:
    """Every refit landed; each receiver got compact frames of exactly the bytes it reported
    for that refit; the trainer re-planned at every change of assignment."""
    buckets = len(plan_of(1).buckets)
    for rank in range(1, len(rounds[0]) + 1):
        for version, got in enumerate(res[rank], 1):
            assert got["outcome"][0] == "ok", (rank, version, got["outcome"])
            assert not got["wrong"], (f"rank {rank} refit v{version} (needs half "
                                      f"{rounds[version - 1][rank - 1]}): buckets {got['wrong']} "
                                      f"hold bytes other than the ones it reported")
            assert got["frames"] == buckets and got["whole"] == 0, (rank, version, got)
    assert [r["replans"] for r in res[0]] == list(range(1, len(rounds) + 1)), res[0]


def test_guarantee_two_workers_swapping_their_needs_makes_the_group_replan() -> None:
    """Receivers 1 and 2 swap their (different) needs after refit 1: the digests are the same
    set, only their owners changed; refit 2 still gives each one exactly the bytes it now
    needs (without a re-plan each would load the other's bytes, and no rank would fail)."""
    rounds = [[0, 1], [1, 0]]
    check_replanned(expect_ok(run_ranks(needs_rank, 3, rounds)), rounds)


def test_guarantee_a_permutation_of_need_sets_across_replicas_replans() -> None:
    """Four receivers in two need-sets, the assignment permuted at each refit (the same
    multiset of reports): every refit lands each receiver's own bytes."""
    rounds = [[0, 0, 1, 1], [1, 0, 1, 0], [0, 1, 1, 0]]
    check_replanned(expect_ok(run_ranks(needs_rank, 5, rounds)), rounds)


COMPACT_DAMAGE = {2: (0, "flip-first"), 3: (3, "flip")}  # receiver rank: (bucket, how)


def compact_corrupted_rank(rank: int, world: int, port: int, damage: dict) -> dict:
    """`corrupted_rank` with the receivers in two compact need-sets: the byte flipped is one
    of a compact frame, not of a whole bucket."""
    if rank < TRAINERS:
        return corrupted_rank(rank, world, port, damage)
    _, group = join(rank, world, port)
    receiver = CorruptingReceiver(group, RefitReceiver.setup(group).plan)
    plan = receiver.plan
    receiver.needs, receiver.damage = needs_for(plan, rank - TRAINERS), damage[rank]
    seen: list[str] = []

    def load(index: int, payload: torch.Tensor) -> None:
        seen.extend(s.name for s in plan.bucket_specs(plan.buckets[index]))

    first = outcome(lambda: receiver.receive(lambda items: seen.extend(n for n, _ in items),
                                             on_compact=load))
    receiver.damage = (-1, "")
    landed = Landed(receiver, tensors(2))
    stats = receiver.receive(landed.whole_bucket, on_compact=landed.compact)
    ok = (stats.version == 2 and stats.need_set >= 0 and not landed.wrong
          and landed.frames == len(plan.buckets) and landed.whole == 0)
    return {"first": first, "second": ("ok", "") if ok else ("wrong", str(vars(landed))),
            "seen": seen, "damaged": [s.name for s in plan.bucket_specs(
                plan.buckets[damage[rank][0]])]}


def test_guarantee_a_flipped_byte_of_a_compact_frame_fails_the_refit_everywhere() -> None:
    """Checksums on, each receiver in its own compact need-set: a flip of the first byte of
    receiver 2's first frame, of the last of receiver 3's bucket 3 frame, fails the refit on
    every rank ("arrived corrupted"), nothing of the frame loaded (receiver 2: nothing at
    all); the next refit lands bit for bit."""
    res = expect_ok(run_ranks(compact_corrupted_rank, 4, COMPACT_DAMAGE))
    for rank in COMPACT_DAMAGE:
        assert res[rank]["first"][0] != "ok", f"rank {rank}: a compact frame's flip went unseen"
    assert res[2]["seen"] == [], res[2]["seen"]
    check_corrupted(res, COMPACT_DAMAGE)


RECEIVER_COMMIT_S, RANK0_COMMIT_S = 0.3, 0.1


def commit_rank(rank: int, world: int, port: int) -> dict:
    """Refits v1 and v2 with a verdict (rank 0 commits, as `EngineFleet.refit`: its refit
    returned, then the engines' commit, then the verdict); each receiver's last step
    (`on_done`) takes `RECEIVER_COMMIT_S`, receiver 3's fails at v2."""
    config, group = join(rank, world, port)
    source, out = DictWeightSource(tensors()), {}
    if group.is_trainer:
        sender = RefitSender.setup(group, RefitPlan.build(source.plan_specs(), config))
        for version in (1, 2):
            group.verdict_by_caller = rank == 0
            out[version] = outcome(lambda v=version: sender.refit(source, v))
            out[f"returned {version}"] = time.monotonic()
            if rank == 0 and out[version][0] == "ok":
                time.sleep(RANK0_COMMIT_S)
                out[f"published {version}"] = time.monotonic()
                group.publish_verdict(None)
        group.destroy()
        return out
    receiver = RefitReceiver.setup(group)
    for version in (1, 2):
        def commit(version: int = version) -> None:
            time.sleep(RECEIVER_COMMIT_S)
            if version == 2 and rank == 3:
                raise RuntimeError("the engine refused to commit")
            out[f"committed {version}"] = time.monotonic()

        out[version] = outcome(lambda v=version, c=commit: receiver.receive(
            lambda items: None, on_done=c, version=v))
    group.destroy()
    return out


def test_guarantee_the_verdict_follows_every_receivers_last_step() -> None:
    """Rank 0 can publish a success verdict only after every receiver's last step ended, and
    trainer 1 returns only after it; a receiver failing its last step fails the refit on
    every rank: no trainer returns success, rank 0 publishes nothing."""
    res = expect_ok(run_ranks(commit_rank, 4))
    assert all(r[1] == ("ok", "") for r in res.values()), res
    committed = max(res[r]["committed 1"] for r in (2, 3))
    assert res[0]["published 1"] > committed, \
        "rank 0 published v1's verdict before a receiver's last step ended"
    assert res[1]["returned 1"] >= res[0]["published 1"], \
        "trainer 1 returned v1 before rank 0 published its verdict"
    assert res[3][2][0] == "RefitError" and "the engine refused to commit" in res[3][2][1]
    for rank in (0, 1, 2):
        kind, msg = res[rank][2]
        assert kind == "RefitAborted" and "failed on [3]" in msg and "refused to commit" in msg, \
            f"rank {rank} took v2 though receiver 3's last step failed: {kind} {msg}"
    assert "published 2" not in res[0], res[0]


def listen_rank(rank: int, world: int, port: int) -> list[tuple[str, int]]:
    """The TCP sockets this rank listens on while its group is up (every rank joined)."""
    group = RefitGroup(host=HOST, port=port, rank=rank, world_size=world, device="cpu",
                       num_trainers=1, timeout_s=30)
    group.all_gather_bytes(b"joined", 8, "joined")
    mine = sorted({(c.laddr.ip, c.laddr.port) for c in
                   psutil.Process().net_connections(kind="tcp")
                   if c.status == psutil.CONN_LISTEN})
    group.all_gather_bytes(b"looked", 8, "looked")  # up until every rank looked
    group.destroy()
    return mine


def test_guarantee_the_refit_store_listens_on_the_groups_address_only() -> None:
    """A group at 127.0.0.1: rank 0's store listens on 127.0.0.1:port, and no rank listens
    on any other address (not 0.0.0.0, not ::)."""
    port = free_port()
    res = expect_ok(run_ranks(listen_rank, 2, port=port))
    assert (HOST, port) in res[0], f"the store is not listening on {HOST}:{port}: {res[0]}"
    for rank, listening in res.items():
        wider = [(ip, p) for ip, p in listening if ip != HOST]
        assert not wider, f"rank {rank} listens wider than {HOST}: {wider}"
