"""Many refits in a row beside a live training group, and a dead receiver over NCCL.

The soak runs the situation every RL job is in: the training ranks have their own default
group (as torchrun makes it) whose gathers build each full tensor while the refit group's
broadcasts of earlier buckets are still on the wire and the buffers rotate. A buffer reused
too early, a stream or thread ordering slip between the two groups, or a collective issued out
of order shows up as a wrong byte on a receiver (checked bit for bit, every tensor, every
refit, against values the receiver computes itself) or as a hang (each run has a deadline).

The soak runs on gloo (CPU) and on NCCL, one GPU per rank. The dead-receiver test is NCCL
only: it runs test_failures.py's dead-peer ranks, whose gloo variant lives there. NCCL tests
are skipped, saying why, unless there is a GPU for every rank.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist

from common.config import RefitConfig
from common.plan import RefitPlan, TensorSpec
from common.source import WeightSource
from common.transfer.sender import RefitReceiver, RefitSender
from common.wire.group import RefitGroup, free_port
from recipes.rank_runner import run_ranks
from tests.multiproc import expect_ok, receive_all
from tests.test_failures import check_dead_peer, dead_peer_rank

LAYERS = 12
# Every NCCL rank sets these before its first communicator: NVLink multicast is off on the
# shared H200 hosts (a program using it can take the host's GPUs out of service).
NO_MULTICAST = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}
# 100 refits on NCCL take seconds. On gloo, 2 shared CPU cores, each refit (26 buckets, 38
# training-group gathers, 3-4 processes) costs ~0.07 s on top of 3-5 s of process start
# (measured: 100 refits 11-12 s a variant): 50 keep both gloo variants near 15 s together for
# `make test-fast` and still turn each of the 2-3 buffers over 400+ times.
REFITS = {"gloo": 50, "nccl": 100}
GROUP_TIMEOUT_S = 30  # a hang surfaces as RefitCommError well inside run_ranks' deadline
BACKENDS = ["gloo", pytest.param("nccl", marks=pytest.mark.gpu)]
# torch 2.13 deprecates all_gather_into_tensor for all_gather_single; the H200 hosts' torch
# 2.11 may have only the older name.
_gather_into = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def need_devices(backend: str, world: int) -> None:
    """Skip an NCCL variant, saying why, unless every rank gets a GPU of its own."""
    if backend != "nccl":
        return
    if torch.cuda.device_count() < world:
        pytest.skip(f"nccl variant: needs {world} GPUs (one per rank), "
                    f"{torch.cuda.device_count()} visible")
    if not dist.is_nccl_available():
        pytest.skip("nccl variant: this torch has no NCCL backend")


def rank_device(backend: str, rank: int) -> torch.device:
    """This process's device: the CPU for gloo; for NCCL GPU `rank`, made current, with NVLink
    multicast turned off before any communicator exists."""
    if backend == "gloo":
        return torch.device("cpu")
    os.environ.update(NO_MULTICAST)
    torch.cuda.set_device(rank)
    return torch.device("cuda", rank)


@dataclass(frozen=True)
class Weight:
    """One tensor of the soak model; `split` is the dim the training ranks shard it along
    (None: every training rank holds it whole)."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    source_rank: int
    split: int | None


@functools.cache
def layout(trainers: int) -> list[Weight]:
    """26 buckets of 4 KiB (with 2 trainers), sent by the training ranks in turn (layer by
    layer; with 1, adjacent layers share packed buckets): an oversize
    embedding, a direct 3 KiB qkv per layer, and a packed bucket per layer that mixes a tensor
    gathered along dim 1 (all_gather + cat), one along dim 0 and a replicated one."""
    bf16, fp16, fp32 = torch.bfloat16, torch.float16, torch.float32
    weights = [Weight("embed.weight", (128, 32), bf16, 0, 0)]  # 8 KiB > a bucket: oversize
    for i in range(LAYERS):
        p, src = f"layers.{i}.", i % trainers
        weights += [Weight(p + "qkv.weight", (48, 32), bf16, src, 0),  # 3 KiB: direct
                    Weight(p + "o.weight", (32, 16), fp32, src, 1),
                    Weight(p + "mlp.weight", (16, 24), fp16, src, 0),
                    Weight(p + "norm.weight", (32,), fp32, src, None)]
    return [*weights, Weight("lm_head.weight", (64, 32), bf16, trainers - 1, 0)]  # direct


def soak_config(buffers: int) -> RefitConfig:
    return RefitConfig(bucket_bytes=4 << 10, direct_bytes=3 << 10, num_buffers=buffers,
                       timeout_s=GROUP_TIMEOUT_S)


def shard(index: int, version: int, part: int, trainers: int) -> torch.Tensor:
    """Training rank `part`'s shard of weight `index` at `version`, from a seed of its own: a
    rank can build only its own shard. A replicated weight is the same whole tensor on every
    rank."""
    weights = layout(trainers)
    w = weights[index]
    shape = list(w.shape)
    if w.split is None:
        part = 0
    else:
        shape[w.split] //= trainers
    g = torch.Generator().manual_seed((version * len(weights) + index) * trainers + part)
    return torch.randn(shape, generator=g).to(w.dtype)


def full(index: int, version: int, trainers: int) -> torch.Tensor:
    """What a receiver must get for weight `index` at `version`, built from every shard."""
    w = layout(trainers)[index]
    if w.split is None:
        return shard(index, version, 0, trainers)
    return torch.cat([shard(index, version, p, trainers) for p in range(trainers)], dim=w.split)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def count_broadcasts(group: RefitGroup) -> Callable[[], int]:
    """Count the refit group's broadcasts (the real ones, passed through) so the source can
    record where its gathers fell among them."""
    issued = [0]
    real = group.broadcast

    def broadcast(tensor: torch.Tensor, src: int, sub: object = None) -> dist.Work:
        issued[0] += 1
        return real(tensor, src, sub)

    group.broadcast = broadcast
    return lambda: issued[0]


class TrainingGatherSource:
    """A WeightSource whose full tensors exist only after a gather over the training group
    (the default group), like a TP gather: each training rank holds one shard per tensor."""

    def __init__(self, rank: int, trainers: int, device: torch.device,
                 issued: Callable[[], int]) -> None:
        self.rank, self.trainers, self.device, self.issued = rank, trainers, device, issued
        self.weights = layout(trainers)
        self.index = {w.name: i for i, w in enumerate(self.weights)}
        self.version = 0
        self.marks: list[int] = []  # refit broadcasts already issued at each gather

    def plan_specs(self) -> list[TensorSpec]:
        return [TensorSpec(w.name, w.shape, w.dtype, w.source_rank) for w in self.weights]

    def iter_tensors(self, plan: RefitPlan) -> Iterator[tuple[str, torch.Tensor]]:
        for spec in plan.specs:
            yield spec.name, self.gather(self.index[spec.name])

    def gather(self, index: int) -> torch.Tensor:
        w = self.weights[index]
        mine = shard(index, self.version, self.rank, self.trainers).to(self.device)
        if w.split is None:
            return mine
        self.marks.append(self.issued())
        if w.split == 0:
            out = torch.empty(w.shape, dtype=w.dtype, device=self.device)
            _gather_into(out, mine)
            return out
        parts = [torch.empty_like(mine) for _ in range(self.trainers)]
        dist.all_gather(parts, mine)
        return torch.cat(parts, dim=w.split)


def soak_trainer(group: RefitGroup, device: torch.device, buffers: int, refits: int) -> dict:
    """Refit versions 1..refits; per refit, where the first and the last gather fell among
    that refit's broadcasts on this rank, and how many it issued (with concurrent sources a
    trainer issues only the frames it sources)."""
    issued = count_broadcasts(group)
    source = TrainingGatherSource(group.rank, group.num_trainers, device, issued)
    assert isinstance(source, WeightSource)
    sender = RefitSender.setup(group, RefitPlan.build(source.plan_specs(), soak_config(buffers)))
    marks = []
    for version in range(1, refits + 1):
        source.version, source.marks = version, []
        start = issued()
        sender.refit(source, version)
        marks.append((source.marks[0] - start, source.marks[-1] - start, issued() - start))
    buckets = sender.plan.buckets
    return {"marks": marks, "buckets": len(buckets),
            "own": sum(b.source_rank == group.rank for b in buckets),
            "sources": sorted({b.source_rank for b in buckets}),
            "direct": sum(b.direct and not b.oversize for b in buckets),
            "oversize": sum(b.oversize for b in buckets)}


def soak_receiver(group: RefitGroup, refits: int) -> dict:
    """Receive every refit and compare each tensor bit for bit with its own expectation; keeps
    going after a mismatch (the ranks stay in step) and reports the first few."""
    receiver = RefitReceiver.setup(group)
    trainers = group.num_trainers
    names = [w.name for w in layout(trainers)]
    wrong: list[str] = []
    checked = 0
    for version in range(1, refits + 1):
        stats, got = receive_all(receiver)
        if stats.version != version or sorted(got) != sorted(names):  # in arrival order
            wrong.append(f"v{version}: got version {stats.version}, names {list(got)[:3]}..")
            continue
        for i, name in enumerate(names):
            want, have = full(i, version, trainers), got[name].cpu()
            checked += 1
            if have.dtype != want.dtype or have.shape != want.shape or \
                    not torch.equal(bits(have), bits(want)):
                wrong.append(f"v{version} {name}: {have.dtype} {list(have.shape)}")
    return {"checked": checked, "wrong": wrong[:5]}


def soak_rank(rank: int, world: int, port: int, backend: str, trainers: int, buffers: int,
              refits: int, train_port: int) -> dict:
    device = rank_device(backend, rank)
    if rank < trainers:  # the training job's default group, made before the refit group
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{train_port}",
                                rank=rank, world_size=trainers,
                                device_id=device if backend == "nccl" else None)
    group = RefitGroup(host="127.0.0.1", port=port, rank=rank, world_size=world,
                       num_trainers=trainers, timeout_s=GROUP_TIMEOUT_S, device=device,
                       name="soak")
    try:
        if group.is_trainer:
            return soak_trainer(group, device, buffers, refits)
        return soak_receiver(group, refits)
    finally:
        group.destroy()
        if dist.is_initialized():
            dist.destroy_process_group()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("trainers,receivers,buffers", [
    pytest.param(2, 1, 2, id="2train-1recv-2buf"),
    pytest.param(2, 2, 3, id="2train-2recv-3buf"),
    pytest.param(1, 1, 2, id="1train-1recv-2buf"),  # the NCCL one that fits on 2 GPUs
])
def test_soak_with_training_gathers_between_broadcasts(backend: str, trainers: int,
                                                       receivers: int, buffers: int) -> None:
    """Every tensor of every refit lands bit for bit on every receiver while the training
    group's gathers run between the refit group's broadcasts."""
    world = trainers + receivers
    need_devices(backend, world)
    refits = REFITS[backend]
    res = expect_ok(run_ranks(soak_rank, world, backend, trainers, buffers, refits,
                              free_port(), timeout=90 if backend == "gloo" else 240))
    for r in range(trainers):
        plan = res[r]
        assert (plan["direct"], plan["oversize"]) == (13, 1), plan
        assert plan["buckets"] == 26 if trainers == 2 else plan["buckets"] > 14, plan
        assert plan["sources"] == list(range(trainers))
        # The first gather ran before any broadcast of its refit, the last one (lm_head's,
        # a direct bucket: header and payload) after every earlier frame this rank takes part
        # in was on the wire: the two groups' collectives interleaved.
        assert all(first == 0 and last >= issued - 2 and issued >= plan["own"] > 0
                   for first, last, issued in plan["marks"]), plan["marks"][:3]
        assert len(plan["marks"]) == refits
    for r in range(trainers, world):
        assert res[r] == {"checked": refits * len(layout(trainers)), "wrong": []}, (r, res[r])


def test_soak_weights_differ_between_versions_and_ranks() -> None:
    """The soak's bit-for-bit check can only catch a stale buffer or a shard from the wrong
    rank if every tensor changes with the version and the shards of one tensor differ."""
    for i, w in enumerate(layout(2)):
        assert not torch.equal(bits(full(i, 1, 2)), bits(full(i, 2, 2))), w.name
        if w.split is not None:
            assert not torch.equal(bits(shard(i, 1, 0, 2)), bits(shard(i, 1, 1, 2))), w.name


@pytest.mark.slow
@pytest.mark.gpu
def test_killed_receiver_over_nccl_makes_every_rank_raise_and_group_can_be_rebuilt() -> None:
    """test_failures.py's dead-peer test (its gloo variant) over NCCL, one GPU per rank: the
    survivors raise RefitCommError within the timeout plus a margin instead of NCCL's watchdog
    tearing the trainer processes down (the group builds NCCL with
    TORCH_NCCL_ASYNC_ERROR_HANDLING=2), then rebuild without the dead rank and refit."""
    need_devices("nccl", 4)
    device_for = functools.partial(rank_device, "nccl")
    check_dead_peer(run_ranks(dead_peer_rank, 4, free_port(), device_for, allow_dead=True,
                              timeout=180))
