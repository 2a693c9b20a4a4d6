"""Frames a weight source fills itself (`PreparedBucket.fill`, how an FP8 source quantizes
straight into the frame on a GPU) over real gloo groups: 2 trainers, 2 receivers. The bytes
land bit for bit; a fill that marks its frame's header status NONFINITE (as the kernel does
for a NaN) is loaded by no receiver, nothing after it either, the refit fails on every rank
naming the tensor, and the next refit lands."""

from __future__ import annotations

import ctypes

import numpy as np
import torch

from common.config import RefitConfig
from common.plan import RefitPlan
from common.source import DictWeightSource, PreparedBucket
from common.transfer.sender import RefitReceiver, RefitSender
from common.wire.group import RefitGroup
from recipes.rank_runner import run_ranks
from tests.multiproc import expect_ok, outcome, receive_all

TRAINERS, BAD = 2, "layers.4.weight"  # a filled slot (every other)


def tensors(version: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(version)
    return {f"layers.{i}.weight": torch.randn(32, 32, generator=g) for i in range(8)}


class FillingSource(DictWeightSource):
    """Each bucket as a `PreparedBucket` whose every other slot the fill writes (copying the
    tensor's bytes in, as a kernel would) and marks NONFINITE when it holds `bad`."""

    def __init__(self, tensors: dict, bad: str | None = None) -> None:
        super().__init__(tensors)
        self.bad, self.fills = bad, 0

    def iter_tensors(self, plan: RefitPlan):
        for bucket in plan.buckets:
            names = tuple(s.name for s in plan.bucket_specs(bucket))
            ts = [self.tensors[n] for n in names]
            yield PreparedBucket(names, np.array([t.data_ptr() for t in ts], dtype=np.int64),
                                 lambda ts=ts: ts, torch.device("cpu"), (ts,),
                                 self._filler(names, ts), np.arange(0, len(names), 2))

    def _filler(self, names: tuple[str, ...], ts: list[torch.Tensor]):
        def fill(slots: np.ndarray, mark: tuple[int, int]):
            self.fills += 1
            for k in range(0, len(names), 2):
                ctypes.memmove(int(slots[k]), ts[k].data_ptr(), ts[k].nbytes)
            marked = self.bad in names[::2]
            if marked:
                ctypes.c_int64.from_address(mark[0]).value = mark[1]
            return lambda: f"{self.bad!r} is not finite" if marked else None
        return fill


def filled_rank(rank: int, world: int, port: int) -> dict:
    config = RefitConfig(bucket_bytes=8 << 10, num_buffers=2, timeout_s=30)
    group = RefitGroup(host="127.0.0.1", port=port, rank=rank, world_size=world,
                       num_trainers=TRAINERS, timeout_s=30)
    if group.is_trainer:
        source = FillingSource(tensors(1))
        sender = RefitSender.setup(group, RefitPlan.build(source.plan_specs(), config))
        first = outcome(lambda: sender.refit(source, 1))
        source.tensors, source.bad = tensors(2), BAD
        second = outcome(lambda: sender.refit(source, 2))
        source.tensors, source.bad = tensors(3), None
        return {"first": first, "second": second, "third": outcome(lambda: sender.refit(
            source, 3)), "fills": source.fills, "bad_bucket": next(
            b.index for b in sender.plan.buckets
            if BAD in [s.name for s in sender.plan.bucket_specs(b)])}
    receiver = RefitReceiver.setup(group)
    seen: list[str] = []
    out = {1: _received(receiver, 1), "seen": seen, "second": outcome(
        lambda: receiver.receive(lambda items: seen.extend(n for n, _ in items)))}
    out[3] = _received(receiver, 3)
    return out


def _received(receiver: RefitReceiver, version: int) -> bool:
    """Whether the next refit brings `version`'s tensors, bit for bit."""
    stats, got = receive_all(receiver)
    return stats.version == version and all(torch.equal(got[n], t)
                                            for n, t in tensors(version).items())


def test_filled_frames_land_and_a_marked_frame_loads_nowhere() -> None:
    res = expect_ok(run_ranks(filled_rank, 4))
    assert res[0]["fills"] + res[1]["fills"] > 3  # every frame of each trainer filled
    for rank in (0, 1):
        assert res[rank]["first"] == res[rank]["third"] == ("ok", ""), res[rank]
    kind, msg = res[0]["second"] if BAD in res[0]["second"][1] else res[1]["second"]
    assert kind == "RefitError" and f"bucket {res[0]['bad_bucket']}/" in msg, msg
    for rank in (2, 3):
        assert res[rank][1] and res[rank][3], res[rank]  # bit for bit, before and after
        kind, msg = res[rank]["second"]
        assert kind == "RefitAborted" and "not finite (NaN or inf)" in msg, msg
        names = list(tensors(0))
        seen = res[rank]["seen"]  # in plan order, nothing from the marked frame on
        assert seen == names[: len(seen)] and BAD not in seen, seen
