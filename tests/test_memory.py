"""Extra memory per rank stays within (N + 1) x bucket bytes + the largest oversize tensor.

Measured, not computed: each process resets its peak resident set size (VmHWM, via
/proc/self/clear_refs) after its model tensors exist, runs setup and two refits, and reads the
new peak. The trainer's source clones every tensor it yields, as a real gather would.
"""

from __future__ import annotations

import pytest
import torch

from common.config import RefitConfig
from common.plan import RefitPlan
from common.transfer.sender import RefitReceiver, RefitSender
from common.wire.group import RefitGroup
from recipes.rank_runner import run_ranks
from tests.multiproc import GatheringSource, expect_ok

MIB = 1 << 20
BUCKET = 8 * MIB
OVERSIZE = 20 * MIB
SLACK = 5 * MIB  # interpreter, gloo and allocator noise (seen: up to 4 MiB)


def peak_rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM")


def reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def model(version: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(version)
    t = {f"w{i}": torch.randn(MIB // 2 - 64 * (i % 3), generator=g) for i in range(40)}
    t["embed"] = torch.randn(OVERSIZE // 4, generator=g)
    return t


def memory_rank(rank: int, world: int, port: int, buffers: int, direct: int) -> int:
    config = RefitConfig(bucket_bytes=BUCKET, num_buffers=buffers, timeout_s=60,
                         direct_bytes=direct)
    group = RefitGroup(host="127.0.0.1", port=port, rank=rank, world_size=world,
                       device="cpu", num_trainers=2, timeout_s=60)
    versions = [model(v) for v in range(3)]  # made before the measured window
    weights = versions[0]
    if group.is_trainer:
        source = GatheringSource(weights)
        plan = RefitPlan.build(source.plan_specs(), config)
        reset_peak()
        base = peak_rss()
        sender = RefitSender.setup(group, plan)
        for v in (1, 2):
            source.tensors = versions[v]
            sender.refit(source, v)
        return peak_rss() - base
    reset_peak()
    base = peak_rss()
    receiver = RefitReceiver.setup(group)

    def load(items):
        for name, t in items:
            weights[name].copy_(t)

    for v in (1, 2):
        receiver.receive(load)
        assert all(torch.equal(weights[n], t) for n, t in versions[v].items())
    return peak_rss() - base


@pytest.mark.parametrize("direct", [BUCKET, MIB], ids=["packed", "direct"])
@pytest.mark.parametrize("buffers", [1, 2, 3])
def test_extra_memory_is_bounded_on_every_rank(buffers: int, direct: int, monkeypatch) -> None:
    # A fixed mmap threshold makes glibc return freed tensors to the OS, so the peak measures
    # what the refit holds, not glibc's heap fragmentation (its dynamic threshold otherwise
    # keeps freed 1 MiB chunks in the heap).
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "131072")
    extra = expect_ok(run_ranks(memory_rank, 3, buffers, direct, fresh_interpreters=True))
    bound = (buffers + 1) * BUCKET + OVERSIZE + SLACK
    for rank, used in extra.items():
        assert used <= bound, f"rank {rank}: {used / MIB:.1f} MiB > {bound / MIB:.1f} MiB"
    print({r: f"{u / MIB:.1f} MiB" for r, u in extra.items()}, f"bound {bound / MIB:.1f} MiB")
