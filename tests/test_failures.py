"""Failures over real gloo groups: plan mismatch, drifted tensors, a failing loader, a dead peer."""

from __future__ import annotations

import dataclasses
import os
import re
import time
from collections.abc import Callable

import pytest
import torch

from common.config import RefitConfig
from common.errors import (
    PlanMismatchError,
    RefitAborted,
    RefitCommError,
    RefitError,
    TensorMismatchError,
)
from common.plan import RefitPlan, TensorSpec
from common.source import DictWeightSource
from common.transfer.sender import RefitReceiver, RefitSender
from common.wire.group import RefitGroup, free_port
from recipes.rank_runner import run_ranks
from tests.multiproc import expect_ok, outcome, receive_all
from tests.test_shard_core import needs_for

TRAINERS = 2


def tensors(version: int = 0, size: int = 32) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(version)
    out = {f"layers.{i}.weight": torch.randn(size, size, generator=g) for i in range(8)}
    out["router.bias"] = torch.randn(16, generator=g)
    return out


def join(rank: int, world: int, port: int, timeout_s: float = 30, name: str = "refit",
         bucket_bytes: int = 8 << 10, device: torch.device | str = "cpu"):
    config = RefitConfig(bucket_bytes=bucket_bytes, num_buffers=2, timeout_s=timeout_s)
    group = RefitGroup(host="127.0.0.1", port=port, rank=rank, world_size=world,
                       device=device, num_trainers=TRAINERS, timeout_s=timeout_s, name=name)
    return config, group


def setup_rank(rank: int, world: int, port: int, case: str) -> tuple[str, str]:
    """Every rank's setup; the last receiver was configured for another model ("shape") or
    runs a refit of another plan format ("format": a peer of another version)."""
    import common.plan

    config, group = join(rank, world, port)
    specs = DictWeightSource(tensors()).plan_specs()
    if rank == world - 1 and case == "format":
        common.plan.PLAN_FORMAT += 1
    if rank == world - 1 and case == "shape":
        specs[3] = TensorSpec(specs[3].name, (32, 64), specs[3].dtype)
        return outcome(lambda: RefitReceiver.setup(group, RefitPlan.build(specs, config)))
    if group.is_trainer:
        return outcome(lambda: RefitSender.setup(group, RefitPlan.build(specs, config)))
    return outcome(lambda: RefitReceiver.setup(group))


@pytest.mark.parametrize("case, said", [
    ("shape", ["rank 3", "layers.3.weight", "[32, 64]"]),
    ("format", ["rank 3: cannot take rank 0's plan: refit plan format"]),
])
def test_a_receiver_that_cannot_take_the_plan_fails_setup_everywhere(case, said) -> None:
    res = expect_ok(run_ranks(setup_rank, 4, case))
    for rank, (kind, msg) in res.items():
        assert kind == "PlanMismatchError", (rank, kind, msg)
        assert all(part in msg for part in said), msg


DRIFTS = {  # what layers.5.weight turns into at refit time (the plan says fp32 32 x 32)
    "dtype": lambda t: t.bfloat16(),
    "same-size-shape": lambda t: t.reshape(16, 64),  # the same bytes, laid out wrongly
}


def drift_rank(rank: int, world: int, port: int, drift: str) -> dict:
    config, group = join(rank, world, port)
    if group.is_trainer:
        source = DictWeightSource(tensors())
        sender = RefitSender.setup(group, RefitPlan.build(source.plan_specs(), config))
        drifted = tensors(1)
        drifted["layers.5.weight"] = DRIFTS[drift](drifted["layers.5.weight"])
        source.tensors = drifted
        first = outcome(lambda: sender.refit(source, 1))
        source.tensors = tensors(2)  # fixed: the same group carries the next refit
        return {"first": first, "second": outcome(lambda: sender.refit(source, 2)),
                "drift_bucket": next(b.index for b in sender.plan.buckets
                                     if "layers.5.weight" in
                                     [s.name for s in sender.plan.bucket_specs(b)])}
    receiver = RefitReceiver.setup(group)
    seen: list[str] = []
    first = outcome(lambda: receiver.receive(lambda items: seen.extend(n for n, _ in items)))
    stats, got = receive_all(receiver)
    second = ("ok", "") if stats.version == 2 else ("wrong version", str(stats.version))
    assert all(torch.equal(got[n], t) for n, t in tensors(2).items())
    return {"first": first, "second": second, "seen": seen}


@pytest.mark.parametrize("drift", DRIFTS)
@pytest.mark.parametrize("native", ["1", "0"])  # the sender's native scan, or its Python path
def test_a_drifted_tensor_fails_on_all_ranks_before_its_bucket(native: str, drift: str,
                                                               monkeypatch) -> None:
    monkeypatch.setenv("REFIT_NATIVE", native)  # the spawned ranks inherit it
    res = expect_ok(run_ranks(drift_rank, 4, drift))
    kind, msg = res[0]["first"]
    said = "bfloat16" if drift == "dtype" else "shape"
    assert kind == "TensorMismatchError" and "'layers.5.weight'" in msg and said in msg, msg
    for rank in (1, 2, 3):
        kind, msg = res[rank]["first"]
        assert kind == "RefitAborted" and "layers.5.weight" in msg, (rank, kind, msg)
    for rank in range(4):
        assert res[rank]["second"] == ("ok", "")
    names = list(tensors())
    for rank in (2, 3):  # nothing from the drifted tensor on was handed to the loader
        seen = res[rank]["seen"]
        assert "layers.5.weight" not in seen and seen == names[: len(seen)]


def unpackable_rank(rank: int, world: int, port: int) -> tuple:
    config, group = join(rank, world, port)
    if group.is_trainer:
        weights = tensors()
        source = DictWeightSource(weights)
        sender = RefitSender.setup(group, RefitPlan.build(source.plan_specs(), config))
        weights["layers.2.weight"] = torch.empty(32, 32, device="meta")  # right spec, no data
        return outcome(lambda: sender.refit(source, 1))
    return outcome(lambda: receive_all(RefitReceiver.setup(group)))


def test_tensor_that_cannot_be_packed_aborts_the_refit_everywhere() -> None:
    res = expect_ok(run_ranks(unpackable_rank, 3))
    assert res[0][0] == "RefitError" and "packing refit v1 bucket" in res[0][1], res[0]
    for rank in (1, 2):
        assert res[rank][0] == "RefitAborted" and "packing refit v1" in res[rank][1], res[rank]


def failing_loader_rank(rank: int, world: int, port: int) -> tuple:
    config, group = join(rank, world, port)
    if group.is_trainer:
        source = DictWeightSource(tensors())
        sender = RefitSender.setup(group, RefitPlan.build(source.plan_specs(), config))
        return outcome(lambda: sender.refit(source, 1)), outcome(lambda: sender.refit(source, 2))
    receiver = RefitReceiver.setup(group)
    calls = []

    def load(items):
        calls.append(len(items))
        if rank == 3 and len(calls) == 2:
            raise KeyError("model has no parameter 'layers.4.weight'")

    return outcome(lambda: receiver.receive(load)), outcome(lambda: receiver.receive(load))


def test_failing_loader_fails_the_refit_on_every_rank_and_next_refit_lands() -> None:
    res = expect_ok(run_ranks(failing_loader_rank, 4))
    assert res[3][0][0] == "RefitError" and "loading bucket 1" in res[3][0][1]
    for rank in (0, 1, 2):
        kind, msg = res[rank][0]
        assert kind == "RefitAborted" and "failed on [3]" in msg and "layers.4.weight" in msg
    assert all(r[1] == ("ok", "") for r in res.values())


TIMEOUT_S = 60.0  # long: every rank must notice a death through the abort, not the timeout
NOTICE_S = 5.0  # the bound on noticing it (generous: the abort poll is 0.25 s)
VICTIMS = {"receiver": 3, "trainer-1": 1, "trainer-0-store-host": 0}


def on_cpu(rank: int) -> torch.device:
    return torch.device("cpu")


class DyingSource(DictWeightSource):
    """A trainer rank's source that kills its process before tensor `after` (mid-refit)."""

    def __init__(self, tensors, after: int) -> None:
        super().__init__(tensors)
        self.after = after

    def iter_tensors(self, plan):
        for i, item in enumerate(super().iter_tensors(plan)):
            if i == self.after:
                os._exit(17)
            yield item


def dead_peer_rank(rank: int, world: int, port: int, port2: int,
                   device_for: Callable[[int], torch.device] = on_cpu,
                   victim: int = 3, shard: bool = False) -> dict:
    """Rank `victim` dies mid-refit; the others must raise fast, rebuild without it, refit.

    `device_for(rank)` picks (and prepares) the rank's device: the CPU (gloo) here, the rank's
    own GPU (NCCL) in test_multi_rank_soak.py's variant. `shard`: the two receivers report
    different needs (each its own need-set and subgroup), so the refit runs as compact frames.
    """
    device = device_for(rank)

    def weights(version: int) -> dict[str, torch.Tensor]:
        return {n: t.to(device) for n, t in tensors(version, 512).items()}

    # 1 MiB tensors in 2 MiB buckets: more than socket buffers hold, so the death is mid-stream.
    config, group = join(rank, world, port, timeout_s=TIMEOUT_S, bucket_bytes=2 << 20,
                         device=device)
    source = DictWeightSource(weights(0))
    if group.is_trainer:
        endpoint = RefitSender.setup(group, RefitPlan.build(source.plan_specs(), config))
        sent = DyingSource(source.tensors, after=3) if rank == victim else source
        run = lambda: endpoint.refit(sent, 1)  # noqa: E731
    else:
        endpoint = RefitReceiver.setup(group)
        if shard:
            endpoint.needs = needs_for(endpoint.plan, rank - TRAINERS)
        calls = []

        def load(*items):
            calls.append(1)
            if rank == victim and len(calls) == 2:
                os._exit(17)  # killed mid-refit
            time.sleep(0.05)

        run = lambda: endpoint.receive(load, on_compact=load)  # noqa: E731
    t0 = time.monotonic()
    try:
        run()
        return {"raised": None}
    except RefitCommError as e:
        first = (type(e).__name__, str(e), time.monotonic() - t0)
    group.destroy()
    return {"raised": first, "rebuilt": rebuild_without(rank, victim, world, port2, device,
                                                         weights(5))}


def rebuild_without(rank: int, victim: int, world: int, port: int, device,
                    weights: dict[str, torch.Tensor]) -> bool:
    """The survivors' new group (ranks shifted down past the dead one) carries refit 2."""
    trainers = TRAINERS - (victim < TRAINERS)
    new_rank = rank - (rank > victim)
    config = RefitConfig(bucket_bytes=2 << 20, num_buffers=2, timeout_s=30)
    group = RefitGroup(host="127.0.0.1", port=port, rank=new_rank, world_size=world - 1,
                       device=device, num_trainers=trainers, timeout_s=30, name="refit-2")
    source = DictWeightSource(weights)
    if group.is_trainer:
        RefitSender.setup(group, RefitPlan.build(source.plan_specs(), config)).refit(source, 2)
        return True
    stats, got = receive_all(RefitReceiver.setup(group))
    return stats.version == 2 and all(torch.equal(got[n], t) for n, t in weights.items())


def check_dead_peer(res: dict, victim: int = 3) -> None:
    """The victim died; every other rank raised RefitCommError naming itself and the bucket
    (or the status exchange) well inside the long timeout, stayed alive and refit again."""
    assert res[victim] == ("dead", 17)
    for rank in sorted(set(res) - {victim}):
        status, value = res[rank]
        assert status == "ok", value
        kind, msg, elapsed = value["raised"]
        assert kind == "RefitCommError" and f"refit rank {rank}/4" in msg, msg
        assert re.search(r"refit (v1 )?(bucket \d+/5|status)", msg), msg
        assert "GLHF" not in msg and ".cc:" not in msg, msg  # the backend's noise is cut
        assert elapsed < NOTICE_S, f"rank {rank} took {elapsed:.1f}s to notice: {msg}"
        assert value["rebuilt"] is True


@pytest.mark.slow
@pytest.mark.parametrize("victim", VICTIMS.values(), ids=VICTIMS.keys())
def test_a_dead_rank_makes_every_other_rank_raise_in_seconds_and_the_group_rebuilds(
        victim: int) -> None:
    res = run_ranks(dead_peer_rank, 4, free_port(), on_cpu, victim, allow_dead=True, timeout=90)
    for rank, (status, value) in sorted(res.items()):
        if status == "ok":
            print(f"rank {rank} raised after {value['raised'][2]:.2f}s: {value['raised'][1]}")
    check_dead_peer(res, victim)


@pytest.mark.slow
@pytest.mark.parametrize("victim", [3, 1], ids=["receiver", "trainer-1"])
def test_shard_a_dead_rank_mid_compact_frames_makes_every_rank_raise_in_seconds(
        victim: int) -> None:
    res = run_ranks(dead_peer_rank, 4, free_port(), on_cpu, victim, True, allow_dead=True,
                    timeout=90)
    check_dead_peer(res, victim)


class CorruptingReceiver(RefitReceiver):
    """Damages bucket `bucket`'s received bytes before they are checked: `flip` the last byte,
    `flip-first` the first one, or `swap` two bytes that differ (the same bytes, other
    positions)."""

    damage: tuple[int, str] = (-1, "")

    def verify_bytes(self, bucket, header, payload, *args, **kwargs):
        index, how = self.damage
        if bucket.index == index:
            if how.startswith("flip"):
                payload[0 if how == "flip-first" else -1] ^= 0xFF
            else:
                i, j = 0, next(k for k in range(1, payload.numel()) if payload[k] != payload[0])
                payload[i], payload[j] = payload[j].clone(), payload[i].clone()
        return super().verify_bytes(bucket, header, payload, *args, **kwargs)


DAMAGE = {2: (1, "swap"), 3: (3, "flip")}  # receiver rank: (bucket, how)


def corrupted_rank(rank: int, world: int, port: int, damage: dict | None = None) -> dict:
    """`damage`: {receiver rank: (bucket, how)} (default `DAMAGE`)."""
    damage = damage or DAMAGE
    config, group = join(rank, world, port)
    config = dataclasses.replace(config, checksum=True)
    if group.is_trainer:
        source = DictWeightSource(tensors())
        sender = RefitSender.setup(group, RefitPlan.build(source.plan_specs(), config))
        source.tensors = tensors(2)
        return {"first": outcome(lambda: sender.refit(source, 1)),
                "second": outcome(lambda: sender.refit(source, 2))}
    receiver = CorruptingReceiver(group, RefitReceiver.setup(group).plan)
    receiver.damage = damage[rank]
    seen: list[str] = []
    first = outcome(lambda: receiver.receive(lambda items: seen.extend(n for n, _ in items)))
    receiver.damage = (-1, "")
    stats, got = receive_all(receiver)
    ok = stats.version == 2 and all(torch.equal(got[n], t) for n, t in tensors(2).items())
    return {"first": first, "second": ("ok", "") if ok else ("wrong", ""), "seen": seen,
            "damaged": [s.name for s in receiver.plan.bucket_specs(
                receiver.plan.buckets[damage[rank][0]])]}


def test_a_flipped_or_swapped_byte_fails_the_refit_everywhere_naming_bucket_and_receiver():
    check_corrupted(expect_ok(run_ranks(corrupted_rank, 4)), DAMAGE)


def check_corrupted(res: dict, damage: dict) -> None:
    """Each damaged receiver names its bucket and loaded nothing of it; the trainers learn
    of every damaged receiver; the same group then carries a clean refit."""
    for rank, (bucket, _) in damage.items():
        kind, msg = res[rank]["first"]
        assert kind == "RefitError" and f"bucket {bucket}/" in msg and "corrupted" in msg, msg
        assert f"refit rank {rank}/4" in msg and "CRC-32" in msg, msg
        assert not set(res[rank]["damaged"]) & set(res[rank]["seen"]), "a damaged tensor loaded"
    for rank in (0, 1):
        kind, msg = res[rank]["first"]
        assert kind == "RefitAborted" and "failed on [2, 3]" in msg and "corrupted" in msg, msg
    assert all(r["second"] == ("ok", "") for r in res.values()), res  # the group carries on


class StallingSource(DictWeightSource):
    """Sleeps `stall_s` before its first tensor (a trainer stuck in a gather, say)."""

    def __init__(self, tensors, stall_s: float) -> None:
        super().__init__(tensors)
        self.stall_s = stall_s

    def iter_tensors(self, plan):
        time.sleep(self.stall_s)
        yield from super().iter_tensors(plan)


PLAN_TIMEOUT_S, JOIN_TIMEOUT_S = 2.0, 30.0


def stalled_sender_rank(rank: int, world: int, port: int) -> tuple[str, str, float]:
    """The plan's timeout (2 s), not the group's join timeout (30 s), bounds the refit's waits."""
    config = RefitConfig(bucket_bytes=8 << 10, timeout_s=PLAN_TIMEOUT_S)
    group = RefitGroup(host="127.0.0.1", port=port, rank=rank, world_size=world, device="cpu",
                       num_trainers=TRAINERS, timeout_s=JOIN_TIMEOUT_S)
    source = DictWeightSource(tensors())
    if group.is_trainer:
        sender = RefitSender.setup(group, RefitPlan.build(source.plan_specs(), config))
        run = lambda: sender.refit(StallingSource(source.tensors, 4.0) if rank == 0  # noqa: E731
                                   else source, 1)
    else:
        receiver = RefitReceiver.setup(group)
        run = lambda: receiver.receive(lambda items: None)  # noqa: E731
    t0 = time.monotonic()
    kind, msg = outcome(run)
    return kind, msg, time.monotonic() - t0


def test_the_plans_timeout_governs_every_wait_after_the_handshake() -> None:
    res = expect_ok(run_ranks(stalled_sender_rank, 4))
    expired = [r for r, (_, msg, _) in res.items() if "within the refit timeout (2s" in msg]
    assert expired, res  # some rank's own wait expired, and says which wait and how long
    for rank, (kind, msg, elapsed) in res.items():
        assert kind == "RefitCommError" and f"refit rank {rank}/4" in msg, (rank, msg)
        assert re.search(r"bucket \d+/5", msg), msg  # the wait that expired or was given up
        bound = 4.0 + 1.0 if rank == 0 else PLAN_TIMEOUT_S + 1.0  # rank 0 was asleep
        assert elapsed < bound, f"rank {rank} raised after {elapsed:.1f}s: {msg}"


def test_error_types_are_refit_errors() -> None:
    for cls in (PlanMismatchError, RefitAborted, RefitCommError, TensorMismatchError):
        assert issubclass(cls, RefitError)


def test_a_receiver_that_joins_before_the_trainers_connects_as_the_store_comes_up() -> None:
    """Engines join before the training ranks are up (their start is slower): the receiver
    connects within a fraction of a second of rank 0's store coming up, however long it
    waited (TCPStore's own retries back off to a minute); with no store at all its join fails
    within its timeout, naming the address."""
    import threading

    port, joined = free_port(), {}

    def receiver() -> None:
        group = RefitGroup(host="127.0.0.1", port=port, rank=1, world_size=2, num_trainers=1,
                           timeout_s=30)
        joined["at"] = time.monotonic()
        group.destroy()

    thread = threading.Thread(target=receiver)
    thread.start()
    time.sleep(6)
    up = time.monotonic()
    trainer = RefitGroup(host="127.0.0.1", port=port, rank=0, world_size=2, num_trainers=1,
                         timeout_s=30)
    thread.join(30)
    trainer.destroy()
    assert joined["at"] - up < 2.0, joined["at"] - up
    t0, lone = time.monotonic(), free_port()
    with pytest.raises(RefitCommError, match=f"127.0.0.1:{lone}.*nothing accepted"):
        RefitGroup(host="127.0.0.1", port=lone, rank=1, world_size=2, num_trainers=1,
                   timeout_s=1)
    assert time.monotonic() - t0 < 5


def test_a_closed_sender_refuses_to_refit() -> None:
    """`RefitSender.close` releases what the sender captured; a refit after it raises, naming
    the rank and the version, instead of failing on what is gone."""
    group = RefitGroup(host="127.0.0.1", port=free_port(), rank=0, world_size=1,
                       num_trainers=1, timeout_s=30)
    try:
        source = DictWeightSource({"w": torch.ones(64), "b": torch.zeros(8)})
        sender = RefitSender.setup(group, RefitPlan.build(source.plan_specs(), RefitConfig()))
        assert sender.refit(source, 1).version == 1
        sender.close()
        with pytest.raises(RefitError, match=r"refit rank 0/1 .*refit v2 on a closed sender"):
            sender.refit(source, 2)
    finally:
        group.destroy()
