"""A CUDA refit cuts its thread's timer slack (so the waits' 20 us sleeps end on time) and gives
it back as it was, on the sender and on the receiver, also after a failed refit; a CPU refit
leaves it alone unless `REFIT_TIMER_SLACK_NS` says otherwise (0: never). A 2-rank gloo group in
this process, the slack set by the variable: the receiver in a thread (the slack is a thread's
own)."""

from __future__ import annotations

import sys
import threading

import pytest
import torch

from common.config import RefitConfig
from common.errors import RefitError
from common.plan import RefitPlan
from common.timer_slack import current_slack_ns, fine_timer_slack
from common.transfer.receiver import RefitReceiver
from common.transfer.sender import RefitSender
from common.wire.group import RefitGroup, free_port
from tests.probe_source import ProbingSource

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux prctl")
TENSORS = {f"w{i}": torch.full((256,), float(i)) for i in range(8)}


def receive(port: int, refits: int, seen: list) -> None:
    group = RefitGroup(host="127.0.0.1", port=port, rank=1, world_size=2, num_trainers=1,
                       device="cpu", timeout_s=30)
    try:
        receiver = RefitReceiver.setup(group)
        for _ in range(refits):
            try:
                receiver.receive(lambda items: seen.append(current_slack_ns()))
            except RefitError:
                pass
            seen.append(("after", current_slack_ns()))
    finally:
        group.destroy()


def test_timer_slack_cut_for_a_refit_and_given_back(monkeypatch) -> None:
    monkeypatch.setenv("REFIT_TIMER_SLACK_NS", "1000")
    before, port, seen = current_slack_ns(), free_port(), []
    assert before is not None and before > 1000  # the kernel's default: 50 us
    thread = threading.Thread(target=receive, args=(port, 2, seen))
    thread.start()
    group = RefitGroup(host="127.0.0.1", port=port, rank=0, world_size=2, num_trainers=1,
                       device="cpu", timeout_s=30)
    try:
        plan = RefitPlan.build(ProbingSource(TENSORS, current_slack_ns).plan_specs(),
                               RefitConfig(bucket_bytes=2048, timeout_s=30))
        sender = RefitSender.setup(group, plan)
        source = ProbingSource(TENSORS, current_slack_ns)
        broken = ProbingSource(TENSORS, current_slack_ns, fail=True)
        sender.refit(source, 1)
        assert source.seen == [1000] * 8 and current_slack_ns() == before
        with pytest.raises(RefitError, match="source broke"):
            sender.refit(broken, 2)
        assert broken.seen == [1000] * 3 and current_slack_ns() == before
    finally:
        thread.join(60)
        group.destroy()
    loads = [s for s in seen if not isinstance(s, tuple)]
    assert loads and set(loads) == {1000}, seen  # in the receiver's thread, per bucket
    assert [s for s in seen if isinstance(s, tuple)] == [("after", before)] * 2


def test_timer_slack_by_device_and_environment(monkeypatch) -> None:
    before = current_slack_ns()
    monkeypatch.delenv("REFIT_TIMER_SLACK_NS", raising=False)
    with fine_timer_slack(cuda=True):
        assert current_slack_ns() == 1000
    with fine_timer_slack(cuda=False):
        assert current_slack_ns() == before
    monkeypatch.setenv("REFIT_TIMER_SLACK_NS", "0")
    with fine_timer_slack(cuda=True):
        assert current_slack_ns() == before
    monkeypatch.setenv("REFIT_TIMER_SLACK_NS", "5000")
    with fine_timer_slack(cuda=False):
        assert current_slack_ns() == 5000
    assert current_slack_ns() == before
    monkeypatch.setenv("REFIT_TIMER_SLACK_NS", "1us")
    with pytest.raises(ValueError, match="REFIT_TIMER_SLACK_NS='1us': a whole number"):
        with fine_timer_slack(cuda=True):
            pass


def test_timer_slack_left_alone_by_a_cpu_refit(monkeypatch) -> None:
    monkeypatch.delenv("REFIT_TIMER_SLACK_NS", raising=False)
    group = RefitGroup(host="127.0.0.1", port=free_port(), rank=0, world_size=1,
                       num_trainers=1, device="cpu", timeout_s=30)
    try:
        source = ProbingSource(TENSORS, current_slack_ns)
        sender = RefitSender.setup(group, RefitPlan.build(source.plan_specs(), RefitConfig()))
        sender.refit(source, 1)
        assert source.seen == [current_slack_ns()] * 8 and source.seen[0] > 1000
    finally:
        group.destroy()
