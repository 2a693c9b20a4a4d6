"""Guarantees of delta refits and the undo log (issue 34) that no other test holds, each held
by a test that fails when the guarantee breaks (`pytest -k guarantee`): the delta mode is agreed
per need-set from every member's base, a rollback also restores the frame whose loader failed,
a verification compares every byte, rebuilt bytes meet the sender's checksum, nothing loads
after a failed frame, and a delta header as large as its frame is refused.

Real gloo groups, spawned ranks, no engine: one trainer (rank 0) and two workers (ranks 1, 2),
whole buckets (no need-sets), the versions of tests/test_delta_refit.py (each changes 3% of the
last's elements, so every frame goes as a delta once the workers hold a base). A worker's
loader writes into its own copy of the weights (`Model`), so what a refit or a rollback left
there is checked bit for bit.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from common.delta import codec as delta
from common.plan import RefitPlan
from common.source import DictWeightSource
from common.transfer.sender import RefitReceiver, RefitSender
from common.wire.group import RefitGroup, free_port
from recipes.rank_runner import run_ranks
from tests.multiproc import expect_ok, outcome
from tests.test_delta_refit import DELTA_CONFIG, version_tensors
from tests.test_roundtrip import bits

WORLD = 3  # rank 0 trains, ranks 1 and 2 are workers
SOURCE_BUCKETS = 6  # DELTA_CONFIG cuts the version tensors into 6 buckets
FAILING_CALL = 3  # a loader call: bucket 2 ('layer.0.q.weight' and five more tensors)


def join(rank: int, world: int, port: int, name: str = "refit", **config: object):
    """This rank's sender or receiver in a new group (`config`: over DELTA_CONFIG)."""
    torch.set_num_threads(1)
    cfg = dataclasses.replace(DELTA_CONFIG, **config)
    group = RefitGroup(host="127.0.0.1", port=port, rank=rank, world_size=world, device="cpu",
                       num_trainers=1, timeout_s=cfg.timeout_s, name=name)
    if group.is_trainer:
        specs = DictWeightSource(version_tensors(1)).plan_specs()
        return RefitSender.setup(group, RefitPlan.build(specs, cfg))
    return RefitReceiver.setup(group)


class Model:
    """A worker's weights as its loader wrote them. Loader call `fail_at` writes the first
    half of its frame's tensors, then raises (a load that failed part way)."""

    def __init__(self, fail_at: int | None = None) -> None:
        self.weights: dict[str, torch.Tensor] = {}
        self.calls: list[list[str]] = []  # the names handed over, per loader call
        self.fail_at = fail_at

    def load(self, items: list) -> None:
        self.calls.append([name for name, _ in items])
        failing = len(self.calls) == self.fail_at
        for name, tensor in items[: (len(items) + 1) // 2] if failing else items:
            self.weights[name] = tensor.clone()
        if failing:
            raise RuntimeError("injected: the loader failed half way through its frame")

    def differs(self, version: int) -> list[str]:
        """The tensors whose bytes are not `version`'s."""
        return [name for name, want in version_tensors(version).items()
                if name not in self.weights or not torch.equal(bits(self.weights[name]),
                                                               bits(want))]


def refit(endpoint, version: int, model: Model | None = None) -> dict:
    """One refit of `version` on this rank: its outcome and, on a worker, what it loaded."""
    if isinstance(endpoint, RefitSender):
        kind, msg = outcome(lambda: endpoint.refit(DictWeightSource(version_tensors(version)),
                                                   version))
        return {"outcome": kind, "error": msg}
    stats: list = []
    kind, msg = outcome(lambda: stats.append(endpoint.receive(model.load)))
    return {"outcome": kind, "error": msg, "calls": len(model.calls),
            "delta_frames": stats[0].delta_frames if stats else None,
            "differs": model.differs(version)}


def test_guarantee_a_set_whose_workers_hold_different_bases_goes_whole() -> None:
    """Worker 2 misses v3 (it sits out the group that carries it) and rejoins holding base v2
    while worker 1 and the trainer hold v3: v4 goes whole to every worker of the set and lands
    bit for bit (deltas on v3 would rebuild worker 2's bytes from the wrong base); v5, once
    every rank holds v4, goes as deltas again."""
    res = expect_ok(run_ranks(missed_refit_rank, WORLD, free_port(), free_port()))
    assert res[1][3]["delta_frames"] == SOURCE_BUCKETS, res[1]  # one base: deltas
    assert 3 not in res[2]
    for rank in (1, 2):
        for version in (2, 3, 4, 5):
            if version in res[rank]:
                assert res[rank][version]["outcome"] == "ok", res[rank][version]
                assert res[rank][version]["differs"] == [], (rank, res[rank][version])
        assert res[rank][4]["delta_frames"] == 0, f"worker {rank} took deltas: {res[rank][4]}"
        assert res[rank][5]["delta_frames"] == SOURCE_BUCKETS, res[rank][5]


def missed_refit_rank(rank: int, world: int, port: int, port2: int, port3: int) -> dict:
    """Group 1 (every rank) carries v1, v2; group 2 (the trainer and worker 1) v3; group 3
    (every rank, each carrying its shadow or base over from its last group) v4, v5."""
    model, out = Model(), {}
    first = join(rank, world, port)
    out.update({v: refit(first, v, model) for v in (1, 2)})
    first.group.destroy()
    last = first
    if rank < 2:
        last = join(rank, 2, port2, "refit-2")
        carry_over(last, first)
        out[3] = refit(last, 3, model)
        last.group.destroy()
    third = join(rank, world, port3, "refit-3")
    carry_over(third, last)
    out.update({v: refit(third, v, model) for v in (4, 5)})
    return out


def carry_over(new, old) -> None:
    if isinstance(new, RefitSender):
        new.keep_shadows_of(old)
    else:
        new.keep_base_of(old)


def loader_fault_rank(rank: int, world: int, port: int) -> dict:
    """v1, v2 land; at v3 worker 2's loader writes half of bucket 2 and raises; every worker
    then rolls back with a loader that works."""
    endpoint, model = join(rank, world, port), Model()
    out = {v: refit(endpoint, v, model) for v in (1, 2)}
    if rank == 2:
        model.fail_at = len(model.calls) + FAILING_CALL
    out[3] = refit(endpoint, 3, model)
    if rank:
        out["torn"] = model.differs(2)  # what v3 left in the weights
        model.fail_at, before = None, len(model.calls)
        out["rolled_back"] = endpoint.roll_back(model.load)
        out["after_rollback"] = model.differs(2)
        out["reloaded"] = [n for names in model.calls[before:] for n in names]
    return out


def test_guarantee_rollback_restores_the_frame_whose_loader_failed() -> None:
    """v3 fails on worker 2 with its weights torn (frames 1-2 and half of bucket 2 are v3's);
    after `roll_back` every tensor, the half-written bucket's included, is v2's bit for bit."""
    res = expect_ok(run_ranks(loader_fault_rank, WORLD))
    assert res[2][2]["delta_frames"] == SOURCE_BUCKETS  # v2 (and so v3) went as deltas
    assert "injected" in res[2][3]["error"], res[2][3]
    assert "layer.0.q.weight" in res[2]["torn"], res[2]["torn"]  # the failing frame wrote
    for rank in (1, 2):
        assert res[rank][3]["outcome"] != "ok" and res[rank]["rolled_back"] > 0, res[rank]
        assert res[rank]["after_rollback"] == [], \
            f"worker {rank} after roll_back, not v2's: {res[rank]['after_rollback']}"
    assert "layer.0.q.weight" in res[2]["reloaded"], res[2]["reloaded"]


def test_guarantee_no_frame_is_loaded_after_a_failed_one_in_delta_mode() -> None:
    """Worker 2's loader fails at its third v3 frame (a delta frame): frames 4-6 still arrive,
    but none of them reaches the loader; worker 1, whose loads all worked, loads every frame
    (the failure reaches it at the end)."""
    res = expect_ok(run_ranks(loader_fault_rank, WORLD))
    loaded = {rank: res[rank][3]["calls"] - res[rank][2]["calls"] for rank in (1, 2)}
    assert loaded[2] == FAILING_CALL, f"worker 2's loader ran {loaded[2]} times at v3"
    assert loaded[1] == SOURCE_BUCKETS, res[1]


def verify_rank(rank: int, world: int, port: int, changed: str | None) -> dict:
    """v1, v2 land (as deltas); the trainer then resends v2 for verification with the last
    element of `changed` altered (None: v2 as it is)."""
    endpoint, model = join(rank, world, port), Model()
    out = {v: refit(endpoint, v, model) for v in (1, 2)}
    if rank == 0:
        tensors = version_tensors(2)
        if changed is not None:
            tensors[changed] = tensors[changed].clone()
            tensors[changed].view(-1)[-1] += 1
        out["verify"] = outcome(lambda: endpoint.refit(DictWeightSource(tensors), 2))
    else:
        out["verify"] = outcome(lambda: endpoint.receive(model.load, verify=True))
    return out


@pytest.mark.parametrize("changed", ["embed.weight", "layer.1.expert.7.weight", None])
def test_guarantee_verify_compares_every_byte_with_deltas_on(changed) -> None:
    """With deltas on and every rank holding v2, a verification of v2 with one element of one
    tensor changed fails on every rank, naming that tensor (a delta-mode verify would rebuild
    the frames from the deltas and compare nothing), in a bucket of its own or in a packed one
    (whose alignment padding holds stale buffer bytes, not compared); v2 as it is passes."""
    res = expect_ok(run_ranks(verify_rank, WORLD, changed))
    assert res[1][2]["delta_frames"] == SOURCE_BUCKETS, res[1]
    for rank in range(WORLD):
        kind, msg = res[rank]["verify"]
        if changed is None:
            assert kind == "ok", f"rank {rank}: the verification of an unchanged v2: {msg}"
            continue
        assert kind != "ok", f"rank {rank}: the verification of a changed {changed!r} passed"
        assert "differs from the bytes this worker holds" in msg, (rank, msg)
        assert f"{changed!r}" in msg, (rank, msg)


def corrupt_base_rank(rank: int, world: int, port: int, index: int) -> dict:
    """v1, v2 land; worker 2's stored base of bucket `index` then has every byte flipped
    before v3."""
    endpoint, model = join(rank, world, port), Model()
    out = {v: refit(endpoint, v, model) for v in (1, 2)}
    if rank == 2:
        endpoint.base.entries[index] ^= 0xFF
    start = len(model.calls)
    out[3] = refit(endpoint, 3, model)
    if rank:
        out["loaded"] = [n for names in model.calls[start:] for n in names]
        plan = endpoint.plan
        out["corrupted"] = [s.name for s in plan.bucket_specs(plan.buckets[index])]
        out["rolled_back"] = outcome(lambda: endpoint.roll_back(model.load))
        out["after_rollback"] = model.differs(2)
    return out


def test_guarantee_bytes_rebuilt_from_a_delta_are_checked_against_the_senders_checksum():
    """Worker 2's base of bucket 2 is corrupted; v3's delta for it rebuilds wrong bytes: the
    refit fails on every rank naming the bucket as rebuilt from its delta, nothing of that
    bucket (nor after it) loads, and every worker rolls back to v2 bit for bit."""
    res = expect_ok(run_ranks(corrupt_base_rank, WORLD, 2))
    msg = res[2][3]["error"]
    assert "bucket 2/6 rebuilt from its delta" in msg, f"worker 2's v3: {res[2][3]}"
    assert "it was not loaded" in msg, msg
    assert "rebuilt from its delta" in res[0][3]["error"], res[0][3]
    assert res[2][2]["delta_frames"] == SOURCE_BUCKETS  # v2 (and so v3) went as deltas
    loaded = res[2]["loaded"]
    assert not set(res[2]["corrupted"]) & set(loaded), f"bucket 2 loaded: {loaded}"
    for rank in (1, 2):
        assert res[rank]["rolled_back"] == ("ok", ""), res[rank]["rolled_back"]
        assert res[rank]["after_rollback"] == [], (rank, res[rank]["after_rollback"])


def oversized_delta_rank(rank: int, world: int, port: int) -> dict:
    """v1 lands; for v2 the trainer's encoder returns "deltas" as large as their frames (a
    peer out of step); the workers' bases are recorded before and after."""
    endpoint, model = join(rank, world, port, timeout_s=5), Model()
    out = {1: refit(endpoint, 1, model)}
    if rank == 0:
        encode = delta.encode

        def as_large(new: torch.Tensor, base: torch.Tensor, version: int) -> torch.Tensor:
            small = encode(new, base, version)
            return torch.cat([small, small.new_zeros(new.numel() - small.numel())])

        delta.encode = as_large
        out[2] = refit(endpoint, 2)
        return out
    before = {i: t.clone() for i, t in endpoint.base.entries.items()}
    out[2] = refit(endpoint, 2, model)
    out["base_kept"] = all(torch.equal(before[i], t) for i, t in endpoint.base.entries.items())
    return out


def test_guarantee_a_delta_header_not_smaller_than_its_frame_is_refused() -> None:
    """A delta header whose payload is as large as its frame fails v2 on every worker at the
    first frame as a protocol out of step, before any write: no loader call, the base as it
    was."""
    res = expect_ok(run_ranks(oversized_delta_rank, WORLD, timeout=60))
    for rank in (1, 2):
        got = res[rank][2]
        assert got["outcome"] == "RefitError", got
        assert "protocol out of step at bucket 0" in got["error"], got
        assert got["calls"] == res[rank][1]["calls"], "a frame was handed to the loader"
        assert res[rank]["base_kept"], "the base was written"
