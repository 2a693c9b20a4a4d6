"""The sender pauses Python's garbage collector for a refit and gives it back as it was: on,
off (a trainer managing collection itself, as Megatron's `--manual-gc`), and after a source
that fails mid-refit; left alone with `REFIT_GC_PAUSE=0`. A world-size-1 gloo group in this
process."""

from __future__ import annotations

import gc

import pytest
import torch

from common.config import RefitConfig
from common.errors import RefitError
from common.plan import RefitPlan
from common.source import DictWeightSource
from common.transfer.sender import RefitSender
from common.wire.group import RefitGroup, free_port
from tests.probe_source import ProbingSource


@pytest.fixture()
def sender_for():
    group = RefitGroup(host="127.0.0.1", port=free_port(), rank=0, world_size=1,
                       num_trainers=1, timeout_s=30, device="cpu")
    tensors = {f"w{i}": torch.full((256,), float(i)) for i in range(8)}
    plan = RefitPlan.build(DictWeightSource(tensors).plan_specs(),
                           RefitConfig(bucket_bytes=2048, timeout_s=30))
    yield tensors, RefitSender.setup(group, plan)
    group.destroy()


@pytest.mark.parametrize("enabled", [True, False])
def test_gc_paused_during_a_refit_and_restored(sender_for, enabled) -> None:
    tensors, sender = sender_for
    (gc.enable if enabled else gc.disable)()
    try:
        source = ProbingSource(tensors, gc.isenabled)
        sender.refit(source, 1)
        assert len(source.seen) == 8 and not any(source.seen)
        assert gc.isenabled() == enabled
        broken = ProbingSource(tensors, gc.isenabled, fail=True)
        with pytest.raises(RefitError, match="source broke"):
            sender.refit(broken, 2)
        assert broken.seen == [False] * 3 and gc.isenabled() == enabled
    finally:
        gc.enable()


def test_gc_left_alone_when_switched_off(sender_for, monkeypatch) -> None:
    tensors, sender = sender_for
    monkeypatch.setenv("REFIT_GC_PAUSE", "0")
    gc.enable()
    source = ProbingSource(tensors, gc.isenabled)
    sender.refit(source, 1)
    assert source.seen == [True] * 8
