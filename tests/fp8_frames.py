"""An FP8 refit's frames on the sender, checked byte for byte (world size 1: the frames stay in
the sender's buffers): run on gloo by `tests/test_fp8_refit.py` and on NCCL, eager and by graph
replay, by `tests/test_gpu_fp8.py`."""

from __future__ import annotations

import re

import pytest
import torch

from common.config import RefitConfig
from common.errors import RefitError
from common.plan import RefitPlan
from common.quant.fp8_blocks import BlockFp8Format, quantize
from common.quant.fp8_plan import Fp8Source, Fp8Targets, scale_name
from common.source import DictWeightSource
from common.transfer.sender import RefitSender
from common.wire.bucket_header import (
    HEADER_BYTES,
    STATUS_ABORT,
    STATUS_NONFINITE,
    STATUS_OK,
    Header,
)
from common.wire.group import RefitGroup, free_port
from tests.test_fp8_refit import bf16_weights, is_target


def frames_hold_the_quantizers_bytes(device: str, graph_send: bool = False) -> int:
    """One FP8 refit of `bf16_weights(1)` on `device`, every bucket in a buffer of its own:
    each frame holds the e4m3 values and scales `quantize` gives and the other tensors as they
    are, bit for bit, and the source handed over some buckets by address (on a GPU: filled
    straight into the frames). Then a refit with a NaN in one expert fails naming it, its
    frame's header not OK (on a GPU the kernel marked it NONFINITE; elsewhere the sender sent
    an ABORT before it), and the next refit lands; new values at the same addresses land bit
    for bit too (with `graph_send`, every whole frame by replay, the filled ones included, a
    dict's frames in runs of several a launch).
    Returns how many tensors were checked."""
    weights = {n: t.to(device) for n, t in bf16_weights(1).items()}
    targets = Fp8Targets(BlockFp8Format(), frozenset(n for n in weights if is_target(n)))
    source = Fp8Source(DictWeightSource(weights), targets)
    config = RefitConfig(bucket_bytes=32 << 10, graph_send=graph_send, timeout_s=60)
    buckets = len(RefitPlan.build(source.plan_specs(), config).buckets)
    plan = RefitPlan.build(source.plan_specs(), RefitConfig(
        bucket_bytes=32 << 10, num_buffers=buckets, graph_send=graph_send, timeout_s=60))
    group = RefitGroup(host="127.0.0.1", port=free_port(), rank=0, world_size=1,
                       num_trainers=1, timeout_s=60, device=device)
    try:
        sender = RefitSender.setup(group, plan)
        sender.refit(source, 1)
        checked = _frames_checked(sender, weights, targets)
        bad = sorted(targets.names)[-1]
        _nan_refit_is_refused(sender, source, weights, bad)
        for tensor in weights.values():
            tensor.mul_(-2)  # exact in bf16
        replays, launches = (sender.graphs.replays, sender.graphs.launches) if graph_send \
            else (0, 0)
        sender.refit(source, 4)
        checked += _frames_checked(sender, weights, targets)
        if graph_send:  # every whole frame by replay, those the source fills too, in runs
            whole = sum(not b.direct for b in plan.buckets)
            assert sender.graphs.replays - replays == whole, (sender.graphs.replays, whole)
            assert 1 < sender.graphs.launches - launches < whole, (sender.graphs.launches,
                                                                   whole)
    finally:
        group.destroy()
    assert source.by_address > 1 and checked > 2 * len(targets.names), (source.by_address,
                                                                          checked)
    return checked


def _frames_checked(sender: RefitSender, weights: dict, targets: Fp8Targets) -> int:
    """Every frame of the last refit holds `weights` as the FP8 checkpoint has them (targets
    quantized, the rest as they are), bit for bit; how many tensors."""
    if next(iter(weights.values())).is_cuda:
        torch.cuda.synchronize()
    want = dict(weights)
    for name in targets.names:
        want[name], want[scale_name(name)] = quantize(name, weights[name], targets.fmt)
    checked = 0
    for bucket in (b for b in sender.plan.buckets if not b.direct):
        for name, got in sender.layouts[bucket.index].unpack():
            assert torch.equal(got.view(torch.uint8), want[name].view(torch.uint8)), name
            checked += 1
    return checked


def _nan_refit_is_refused(sender: RefitSender, source: Fp8Source, weights: dict,
                          bad: str) -> None:
    """A refit with a NaN in `bad` fails naming it, its bucket's frame header is not OK (a
    GPU fill marks it NONFINITE), and the next refit lands with OK headers."""
    plan = sender.plan
    bucket = next(b for b in plan.buckets if bad in [s.name for s in plan.bucket_specs(b)])
    clean = weights[bad]
    weights[bad] = clean.clone()
    weights[bad][3, 5] = float("nan")
    with pytest.raises(RefitError, match=re.escape(repr(bad))):
        sender.refit(source, 2)
    status = Header.decode(sender.bucket_buffer(bucket)[:HEADER_BYTES].cpu()).status
    fill = clean.is_cuda  # the kernel quantizes into the frames there
    assert status == (STATUS_NONFINITE if fill else STATUS_ABORT), status
    weights[bad] = clean
    sender.refit(source, 3)
    assert Header.decode(sender.bucket_buffer(bucket)[:HEADER_BYTES].cpu()).status == STATUS_OK
