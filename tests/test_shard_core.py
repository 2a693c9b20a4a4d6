"""Shard-to-shard over real gloo refit groups: compact frames per need-set, bit for bit.

Two trainers (so frames come from two sources, and a trainer takes part in frames it does not
send) and four receivers: two with equal needs (one need-set), one with other needs, one
with none reported (whole buckets). The tensors are the round-trip set: mixed dtypes, direct
and oversize buckets, 0-d, empty and non-contiguous tensors.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from common.config import RefitConfig
from common.errors import NeedsRefusedError
from common.plan import RefitPlan
from common.shard.frames import CompactBuffers
from common.shard.needs import ByteRanges, Needs
from common.shard.plan import Gather
from common.source import DictWeightSource
from common.transfer.sender import RefitReceiver, RefitSender
from common.wire.group import RefitGroup
from recipes.rank_runner import run_ranks
from tests.multiproc import expect_ok
from tests.test_roundtrip import make_tensors

TRAINERS, WORLD = 2, 6
CONFIG = RefitConfig(bucket_bytes=16 << 10, num_buffers=2, timeout_s=60, direct_bytes=2 << 10,
                     checksum=True)


def split_tensors(version: int) -> dict[str, torch.Tensor]:
    return make_tensors(0, version)


class TwoSources(DictWeightSource):
    """The second half of the tensors is sourced by trainer 1."""

    def plan_specs(self) -> list:
        specs = super().plan_specs()
        return [dataclasses.replace(s, source_rank=int(i >= len(specs) // 2))
                for i, s in enumerate(specs)]


def source_of(rank: int, version: int) -> DictWeightSource:
    return TwoSources(split_tensors(version))


def needs_for(plan: RefitPlan, half: int) -> Needs:
    """Every tensor's first (`half` 0) or second (`half` 1) half of its bytes, in 16-byte
    rows; set 1 also reads the first 16 bytes (a norm-like range both sets read)."""
    out = {}
    for bucket in plan.buckets:
        starts, lengths = [], []
        for pos, spec in zip(range(bucket.stop - bucket.start), plan.bucket_specs(bucket),
                             strict=True):
            n = spec.nbytes // 2
            if n:
                starts.append(bucket.offsets[pos] + half * n)
                lengths.append(spec.nbytes - n if half else n)
        if half:
            starts.append(0)
            lengths.append(min(16, bucket.nbytes))
        out[bucket.index] = ByteRanges.of(np.array(starts), np.array(lengths))
    return Needs(out)


def bucket_image(plan: RefitPlan, index: int, tensors: dict[str, torch.Tensor]) -> np.ndarray:
    """A bucket's payload bytes as the sender packs them (zeros between tensors)."""
    bucket = plan.buckets[index]
    image = np.zeros(bucket.nbytes, dtype=np.uint8)
    for offset, spec in zip(bucket.offsets, plan.bucket_specs(bucket), strict=True):
        raw = tensors[spec.name].contiguous().reshape(-1).view(torch.uint8).numpy()
        image[offset : offset + spec.nbytes] = raw
    return image


def shard_rank(rank: int, world: int, port: int, refused: bool = False) -> dict:
    torch.set_num_threads(1)
    group = RefitGroup(host="127.0.0.1", port=port, rank=rank, world_size=world, device="cpu",
                       num_trainers=TRAINERS, timeout_s=CONFIG.timeout_s)
    if group.is_trainer:
        first = source_of(rank, 1)
        sender = RefitSender.setup(group, RefitPlan.build(first.plan_specs(), CONFIG))
        out = {}
        for version in (1, 2, 3):
            stats = sender.refit(source_of(rank, version), version)
            out[version] = {r: (t["need_set"], t["wire_bytes"]) for r, t in
                            stats.receivers.items()}
        out["replans"] = sender.sharding.replans
        return out
    receiver = RefitReceiver.setup(group)
    plan = receiver.plan
    if refused and rank == 3:
        receiver.needs = Needs({len(plan.buckets): ByteRanges.of(np.array([0]),
                                                                 np.array([8]))})
    elif rank in (2, 3, 4):
        receiver.needs = needs_for(plan, int(rank == 4))
    out = {}
    for version in (1, 2, 3):
        if version == 3 and rank == 5:
            receiver.needs = needs_for(plan, 0)  # joins set 0 at this refit's re-plan
        want = split_tensors(version)
        checked = [0]

        def whole(items: list, want: dict = want, checked: list = checked) -> None:
            for name, got in items:
                w = want[name]
                assert torch.equal(got.contiguous().reshape(-1).view(torch.uint8),
                                   w.contiguous().reshape(-1).view(torch.uint8)), name
                checked[0] += 1

        def compact(index: int, payload: torch.Tensor, want: dict = want,
                    checked: list = checked) -> None:
            ranges = receiver.needs.buckets[index]
            image, got = bucket_image(plan, index, want), payload.numpy()
            for place, start, length in zip(ranges.placed(), ranges.starts, ranges.lengths,
                                            strict=True):
                assert np.array_equal(got[place : place + length],
                                      image[start : start + length]), (index, start)
            checked[0] += 1

        stats = receiver.receive(whole, on_compact=compact, version=version)
        out[version] = {"need_set": stats.need_set, "checked": checked[0],
                        "wire": stats.wire_bytes}
    return out


def test_shard_frames_reach_each_need_set_bit_for_bit() -> None:
    res = expect_ok(run_ranks(shard_rank, WORLD))
    plan = RefitPlan.build(source_of(0, 1).plan_specs(), CONFIG)
    assert res[2][1]["need_set"] == res[3][1]["need_set"] == 0  # equal needs: one set
    assert res[4][1]["need_set"] == 1 and res[5][1]["need_set"] == 2  # 5: whole buckets
    for rank in (2, 3, 4):
        assert res[rank][1]["checked"] == len(plan.buckets)  # every bucket has bytes for it
        # about half the bytes (plus headers and 16-byte placement) against every byte
        assert res[rank][2]["wire"] < 0.75 * res[5][2]["wire"], res
    assert res[5][1]["checked"] == len(plan.specs)
    assert res[5][3]["need_set"] == 0  # reported at refit 3: re-planned into set 0
    assert res[0]["replans"] == 2 and res[1]["replans"] == 2  # refits 1 and 3, not 2
    assert res[0][2] == res[1][2]  # every trainer sees every receiver's figures
    assert res[0][2][2] == (0, res[2][2]["wire"]) and res[0][3][5][0] == 0


def refused_rank(rank: int, world: int, port: int) -> tuple[str, str, list[int]]:
    try:
        shard_rank(rank, world, port, refused=True)
    except NeedsRefusedError as e:
        return type(e).__name__, str(e), list(e.ranks)
    return "ok", "", []


def test_shard_need_report_outside_the_plan_is_refused_naming_the_worker() -> None:
    seen = expect_ok(run_ranks(refused_rank, WORLD))
    for rank, (kind, message, ranks) in seen.items():
        assert kind == NeedsRefusedError.__name__ and ranks == [3], (rank, kind, message)
        assert "refit rank 3" in message and "is not in the plan" in message, message
        assert "nothing of it was loaded" in message


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("aligned", [True, False])
def test_shard_gather_copies_each_piece_bit_for_bit(device: str, aligned: bool) -> None:
    """Ranges crossing tensor ends and the alignment gaps between them, rows of a
    row-parallel tensor; sources aligned (CUDA: the pointer-table kernel) or not (a tensor at
    an odd address: the per-piece copies)."""
    g = torch.Generator().manual_seed(1)
    tensors = {"a": torch.randn(300, generator=g).bfloat16(),  # 600 bytes, then a gap
               "rows": torch.randn(64, 48, generator=g),  # row-parallel: half of each row
               "c": torch.randint(0, 255, (1000,), generator=g, dtype=torch.uint8)}
    plan = RefitPlan.build(DictWeightSource(tensors).plan_specs(),
                           RefitConfig(bucket_bytes=1 << 20, direct_bytes=1 << 20))
    (bucket,) = plan.buckets
    rows = bucket.offsets[1] + np.arange(64) * 48 * 4
    ranges = ByteRanges.of(np.concatenate([[10, 590], rows + 96, [bucket.offsets[2] + 3]]),
                           np.concatenate([[100, bucket.offsets[1] + 40 - 590],
                                           np.full(64, 96), [997]]))
    gather = Gather.of(bucket, [s.nbytes for s in plan.bucket_specs(bucket)], ranges)
    on = {n: t.to(device) for n, t in tensors.items()}
    if not aligned:  # "c" at an odd address
        on["c"] = torch.zeros(1001, dtype=torch.uint8, device=device)[1:].copy_(on["c"])
    buffers = CompactBuffers(torch.device(device), 512, gather.nbytes, 2)
    buffers.fill(0, 0, gather, [on[s.name] for s in plan.bucket_specs(bucket)], None)
    got = buffers.payload(0, gather).cpu().numpy()
    image = bucket_image(plan, 0, tensors)
    for place, start, length in zip(ranges.placed(), ranges.starts, ranges.lengths,
                                    strict=True):
        tail = max(0, start + length - bucket.nbytes)  # no bytes past the bucket
        end = start + length - tail
        # a gap between tensors is not copied: compare only bytes inside tensors
        inside = np.zeros(bucket.nbytes, dtype=bool)
        for o, s in zip(bucket.offsets, plan.bucket_specs(bucket), strict=True):
            inside[o : o + s.nbytes] = True
        keep = inside[start:end]
        assert np.array_equal(got[place : place + end - start][keep], image[start:end][keep])
