"""Bitwise round trips of mixed-dtype tensor sets over real gloo refit groups."""

from __future__ import annotations

import pytest
import torch

from common.config import RefitConfig
from common.plan import RefitPlan
from common.source import DictWeightSource
from common.transfer.sender import RefitReceiver, RefitSender
from common.wire.bucket_header import HEADER_BYTES
from common.wire.group import RefitGroup
from recipes.rank_runner import run_ranks
from tests.multiproc import expect_ok, receive_all


def make_tensors(seed: int, version: int = 0) -> dict[str, torch.Tensor]:
    """Mixed dtypes, an oversize tensor, empty and 0-d tensors, a non-contiguous one."""
    g = torch.Generator().manual_seed(seed * 1000 + version)
    t = {
        "embed.weight": torch.randn(64, 32, generator=g).bfloat16(),
        "big.weight": torch.randn(300, 64, generator=g),  # 76.8 KB > 16 KiB bucket: oversize
        "layer.0.q.weight": torch.randn(16, 16, generator=g).half(),
        "layer.0.count": torch.randint(-(2**40), 2**40, (7,), generator=g),
        "layer.0.mask": torch.rand(33, generator=g) > 0.5,
        "layer.0.scalar": torch.randn((), generator=g),
        "layer.0.empty": torch.empty(0, 5),
        "layer.0.t.weight": torch.randn(24, 40, generator=g).bfloat16().t(),  # non-contiguous
        "layer.2.t.weight": torch.randn(48, 40, generator=g).bfloat16().t(),  # direct, strided
    }
    for i in range(40):
        t[f"layer.1.expert.{i}.weight"] = torch.randn(8, 24, generator=g).bfloat16()
    t["norm.bias"] = torch.randn(5, generator=g).to(torch.float32)
    return t


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def roundtrip_rank(rank: int, world: int, port: int, trainers: int, buffers: int) -> dict:
    # 16 KiB buckets; tensors from 2 KiB on go direct (embed, layer.2.t), "big" is oversize.
    config = RefitConfig(bucket_bytes=16 << 10, num_buffers=buffers, timeout_s=60,
                         direct_bytes=2 << 10)
    group = RefitGroup(host="127.0.0.1", port=port, rank=rank, world_size=world,
                       device="cpu", num_trainers=trainers, timeout_s=config.timeout_s)
    out = {}
    if group.is_trainer:
        source = DictWeightSource(make_tensors(0))
        sender = RefitSender.setup(group, RefitPlan.build(source.plan_specs(), config))
        for version in (1, 2):
            source.tensors = make_tensors(0, version)
            stats = sender.refit(source, version)
        plan = sender.plan  # each bucket's broadcasts: header + payload, or header then payload
        sent = sum(sender.headers[0].numel() + b.nbytes if b.direct
                   else sender.bucket_buffer(b).numel() for b in plan.buckets)
        return {"buckets": len(plan.buckets), "direct": sum(b.direct for b in plan.buckets),
                "wire": stats.wire_bytes, "sent": sent, "total": plan.total_bytes,
                "receivers_wire": {r: t["wire_bytes"] for r, t in stats.receivers.items()}}
    receiver = RefitReceiver.setup(group)
    for version in (1, 2):
        stats, got = receive_all(receiver)
        want = make_tensors(0, version)
        assert stats.version == version
        assert list(got) == list(want), "names or order differ"
        for name, w in want.items():
            g = got[name]
            assert g.dtype == w.dtype and g.shape == w.shape, name
            assert torch.equal(bits(g), bits(w)), name
        out[version] = len(got)
    return out


@pytest.mark.parametrize("buffers", [1, 2, 3])
@pytest.mark.parametrize("trainers,receivers", [(1, 1), (2, 1), (1, 2), (2, 2), (3, 2)])
def test_roundtrip_bitwise(trainers: int, receivers: int, buffers: int) -> None:
    res = expect_ok(run_ranks(roundtrip_rank, trainers + receivers, trainers, buffers))
    assert res[0]["buckets"] > 3 and res[0]["direct"] == 3
    for r in range(trainers, trainers + receivers):
        assert res[r] == {1: len(make_tensors(0)), 2: len(make_tensors(0))}
    # every rank of a broadcast moves its bytes: each bucket's header and payload, the
    # status exchange not counted; the receivers report theirs in the status records
    wire = res[0]["wire"]
    assert wire == res[0]["sent"] > res[0]["total"] + res[0]["buckets"] * HEADER_BYTES, res[0]
    assert res[0]["receivers_wire"] == dict.fromkeys(range(trainers, trainers + receivers), wire)
