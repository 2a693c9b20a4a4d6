"""Delta refits and the undo log over real gloo refit groups, bit for bit.

Two trainers (frames from two sources; each takes part in the other's) and four receivers:
two with equal needs (need-set 0), one with other needs (set 1), one taking whole buckets.
Each version after the first changes a few percent of the elements of the last (as RL steps
do), so frames go as deltas; the round-trip tensors cover mixed dtypes, direct and oversize
buckets, 0-d, empty and non-contiguous tensors.
"""

from __future__ import annotations

import dataclasses
from functools import partial

import numpy as np
import torch

from common.delta.frames import DELTA
from common.errors import RefitError
from common.plan import RefitPlan
from common.transfer.sender import RefitReceiver, RefitSender
from common.wire.group import RefitGroup
from recipes.rank_runner import run_ranks
from tests.multiproc import expect_ok
from tests.test_roundtrip import make_tensors
from tests.test_shard_core import CONFIG, TRAINERS, WORLD, TwoSources, bucket_image, needs_for

DELTA_CONFIG = dataclasses.replace(CONFIG, delta=True, undo_bytes=64 << 20)


def version_tensors(version: int) -> dict[str, torch.Tensor]:
    """v1: random; each later version: 3% of the last's floating elements changed."""
    tensors = make_tensors(0, 1)
    for v in range(2, version + 1):
        g = torch.Generator().manual_seed(v)
        for name, t in tensors.items():
            if t.is_floating_point() and t.numel():
                flat = t.contiguous().reshape(-1).clone()
                pick = torch.rand(flat.numel(), generator=g) < 0.03
                flat[pick] += torch.randn(int(pick.sum()), generator=g).to(flat.dtype)
                tensors[name] = flat.view(t.contiguous().shape)
    return tensors


class Checker:
    """Receive callbacks that check every byte against one version's tensors."""

    def __init__(self, receiver: RefitReceiver, want: dict[str, torch.Tensor]) -> None:
        self.receiver, self.want, self.checked = receiver, want, 0

    def whole(self, items: list) -> None:
        for name, got in items:
            w = self.want[name].contiguous().reshape(-1).view(torch.uint8)
            assert torch.equal(got.contiguous().reshape(-1).view(torch.uint8), w), name
            self.checked += 1

    def compact(self, index: int, payload: torch.Tensor) -> None:
        plan, ranges = self.receiver.plan, self.receiver.needs.buckets[index]
        image, got = bucket_image(plan, index, self.want), payload.numpy()
        for place, start, length in zip(ranges.placed(), ranges.starts, ranges.lengths,
                                        strict=True):
            assert np.array_equal(got[place : place + length], image[start : start + length])
        self.checked += 1


class DamagingReceiver(RefitReceiver):
    """Adds one to the changed-word count in the preamble of the delta frames of
    `damage_version` as they land (a malformed delta, not caught by a checksum here)."""

    damage_version = -1

    def verify_bytes(self, bucket, header, payload, *args, **kwargs):
        if header.version == self.damage_version and header.kind == DELTA:
            payload[24] += 1  # the preamble's changed-word count (little-endian, low byte)
        return super().verify_bytes(bucket, header, payload, *args, **kwargs)


def delta_rank(rank: int, world: int, port: int, fail_at: int | None = None,
               fault: str = "loader", **config: object) -> dict:
    """Refits v1..v4 (`config`: RefitConfig fields over DELTA_CONFIG's); with `fail_at`, rank
    4 fails that version: its loader at the third frame ("loader"), or its delta frames arrive
    malformed ("malformed")."""
    torch.set_num_threads(1)
    config = dataclasses.replace(DELTA_CONFIG, **config)
    group = RefitGroup(host="127.0.0.1", port=port, rank=rank, world_size=world, device="cpu",
                       num_trainers=TRAINERS, timeout_s=config.timeout_s)
    versions = (1, 2, 3, 4)
    if group.is_trainer:
        source = TwoSources(version_tensors(1))
        mine = dataclasses.replace(config, shadow="host") if rank == 1 else config  # local
        sender = RefitSender.setup(group, RefitPlan.build(source.plan_specs(), mine))
        out = {"shadow": sender.plan.config.shadow}
        for version in versions:
            try:
                stats = sender.refit(TwoSources(version_tensors(version)), version)
            except RefitError as e:
                out[version] = f"failed: {e}"
                continue
            out[version] = {r: (t["need_set"], t["wire_bytes"], t["delta_frames"])
                            for r, t in stats.receivers.items()}
        return out
    receiver = DamagingReceiver.setup(group)
    if rank in (2, 3, 4):
        receiver.needs = needs_for(receiver.plan, int(rank == 4))
    if rank == 4 and fault == "malformed":
        receiver.damage_version = fail_at
    return {version: receive_version(receiver, version, fail_at == version and rank == 4
                                     and fault == "loader") for version in versions}


def receive_version(receiver: RefitReceiver, version: int, fail: bool) -> dict:
    """One refit, checked bit for bit; after a failure, the rollback checked against the
    last version (or its refusal)."""
    check = Checker(receiver, version_tensors(version))
    on_bucket, on_compact = check.whole, check.compact
    if fail:
        def on_compact(index: int, payload: torch.Tensor, check: Checker = check) -> None:
            if check.checked == 2:
                raise RuntimeError("injected loader failure")
            check.compact(index, payload)
    try:
        stats = receiver.receive(on_bucket, on_compact=on_compact, version=version)
    except RefitError as e:
        back = Checker(receiver, version_tensors(version - 1))
        try:
            rolled = receiver.roll_back(back.whole, back.compact)
        except RefitError as refused:
            rolled = str(refused)
        return {"failed": str(e), "applied": check.checked, "rolled_back": rolled,
                "checked_back": back.checked}
    return {"need_set": stats.need_set, "checked": check.checked,
            "wire": stats.wire_bytes, "delta_frames": stats.delta_frames}


def test_delta_refits_bit_for_bit_with_a_fraction_of_the_bytes() -> None:
    res = expect_ok(run_ranks(delta_rank, WORLD))
    for rank in (2, 3, 4, 5):
        first, later = res[rank][1], res[rank][3]
        assert first["delta_frames"] == 0  # nobody holds a base yet: whole frames
        assert later["delta_frames"] > 0, res[rank]
        assert later["wire"] < 0.35 * first["wire"], (rank, first, later)
    assert res[0][3] == res[1][3]  # every trainer sees every receiver's figures
    # where a trainer keeps its shadow is its own setting: rank 0's plan does not carry it
    assert (res[0]["shadow"], res[1]["shadow"]) == ("device", "host")


def test_rollback_after_a_loader_failure_then_the_next_delta_lands() -> None:
    res = expect_ok(run_ranks(delta_rank, WORLD, 3))
    for rank in (0, 1):
        assert res[rank][3].startswith("failed") and "injected loader failure" in res[rank][3]
    for rank in (2, 3, 4, 5):
        failed = res[rank][3]
        assert "injected loader failure" in failed["failed"]
        # every frame it applied of v3 was handed over again from its base (v2), bit for bit
        # (the Checker raises on a byte that is not v2's; rank 4's failing frame is re-applied
        # too: it may have loaded a part)
        assert failed["rolled_back"] >= 1 and failed["checked_back"] >= failed["applied"]
        after = res[rank][4]  # v4 goes as deltas against v2, the version every rank holds
        assert after["delta_frames"] > 0 and after["checked"] > 0, after


def test_rollback_refused_when_the_undo_log_outgrew_its_budget() -> None:
    """A 64-byte undo log: the failed v3 cannot be undone, each worker says why; the base is
    forgotten, so v4 goes whole and lands."""
    res = expect_ok(run_ranks(partial(delta_rank, undo_bytes=64), WORLD, 3, "loader"))
    for rank in (2, 3, 4, 5):
        refused = res[rank][3]["rolled_back"]
        assert "cannot roll back" in refused and "budget of 64 bytes" in refused, refused
        assert res[rank][4]["delta_frames"] == 0 and res[rank][4]["checked"] > 0, res[rank][4]


def test_delta_a_malformed_delta_is_refused_naming_the_bucket_and_rolled_back() -> None:
    """Rank 4's delta frames of v3 arrive malformed (no checksum): it refuses the first
    before writing a byte, naming the bucket and its first tensor; every rank fails v3,
    every worker rolls back to v2 and v4 lands as deltas."""
    res = expect_ok(run_ranks(partial(delta_rank, checksum=False), WORLD, 3, "malformed"))
    failed = res[4][3]["failed"]
    assert "its delta was refused, nothing of it loaded" in failed, failed
    assert "malformed or truncated" in failed and "bucket 0 ('" in failed, failed
    for rank in (2, 3, 4, 5):
        assert isinstance(res[rank][3]["rolled_back"], int), res[rank][3]
        assert res[rank][4]["delta_frames"] > 0, res[rank][4]
