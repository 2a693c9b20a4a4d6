"""CUDA code paths: NCCL refit group, packing on the GPU, measured GPU memory (skipped on CPU)."""

from __future__ import annotations

import pytest
import torch

from common.config import RefitConfig
from common.plan import RefitPlan
from common.transfer.sender import RefitSender
from common.wire.group import RefitGroup, free_port
from recipes.rank_runner import run_ranks
from tests.multiproc import GatheringSource, expect_ok

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
MIB = 1 << 20


def model(version: int) -> dict[str, torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(version)
    t = {f"experts.{i}.w": torch.randn(96 * 1024, generator=g, device="cuda").bfloat16()
         for i in range(2000)}  # 2,000 small tensors: 375 MiB of bf16
    t["embed"] = torch.randn(64 * MIB, generator=g, device="cuda").bfloat16()  # 128 MiB
    t["router.bias"] = torch.randn(64, generator=g, device="cuda")
    return t


def nccl_rank(rank: int, world: int, port: int, buffers: int, graph_send: bool) -> dict:
    torch.cuda.set_device(0)
    bucket = 32 * MIB
    config = RefitConfig(bucket_bytes=bucket, num_buffers=buffers, timeout_s=60,
                         graph_send=graph_send)
    group = RefitGroup(host="127.0.0.1", port=port, rank=0, world_size=1, num_trainers=1,
                       timeout_s=60)
    assert group.backend == "nccl"
    versions = [model(v) for v in range(3)]
    source = GatheringSource(versions[0])
    plan = RefitPlan.build(source.plan_specs(), config)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.max_memory_allocated()
    sender = RefitSender.setup(group, plan)
    times = []
    for v in (1, 2):
        source.tensors = versions[v]
        times.append(sender.refit(source, v).seconds)
    # The last bucket's buffer holds the packed tail of version 2, bit for bit.
    last = max((b for b in plan.buckets if not b.oversize), key=lambda b: b.index)
    packed = sender.layouts[last.index].unpack()
    ok = all(torch.equal(t, versions[2][n]) for n, t in packed)
    extra = torch.cuda.max_memory_allocated() - base
    group.destroy()
    return {"extra": extra, "bound": (buffers + 1) * bucket + 128 * MIB, "ok": ok,
            "times": times, "buckets": len(plan.buckets)}


@pytest.mark.parametrize("graph_send", [True, False])
@pytest.mark.parametrize("buffers", [1, 2, 3])
def test_nccl_world_size_one_refit_and_gpu_memory_bound(buffers: int, graph_send: bool) -> None:
    """Frames by graph replay (the default) and eagerly: bytes right, memory within bounds."""
    (res,) = expect_ok(run_ranks(nccl_rank, 1, buffers, graph_send)).values()
    assert res["ok"], "packed bytes differ"
    slack = 4 * MIB  # header buffers, caching-allocator rounding
    assert res["extra"] <= res["bound"] + slack, res
    print(res)


def test_one_launch_pack_kernel_is_bitwise_and_falls_back_for_misaligned_sources() -> None:
    from common.packing import BucketLayout
    from common.plan import TensorSpec

    g = torch.Generator(device="cuda").manual_seed(0)
    tensors = [torch.randn(n, generator=g, device="cuda").to(dt)
               for n, dt in [(5000, torch.bfloat16), (33, torch.float32), (7, torch.bfloat16),
                             (70000, torch.float16), (1, torch.float32)]]
    tensors.append(torch.arange(9, device="cuda") % 2 == 0)
    specs = [TensorSpec.of(f"t{i}", t) for i, t in enumerate(tensors)]
    plan = RefitPlan.build(specs, RefitConfig(bucket_bytes=1 << 20))
    (bucket,) = plan.buckets
    buf = torch.zeros(bucket.nbytes, dtype=torch.uint8, device="cuda")
    layout = BucketLayout(buf, specs, bucket.offsets)
    assert sorted(k.unit for _, k in layout.kernels) == [1, 2, 4, 8]  # bool 9 B, bf16 7 x 2 B..
    assert layout._pack_kernel(tensors, None)  # the one-launch path itself
    assert all(torch.equal(v, t) for (_, v), t in zip(layout.unpack(), tensors, strict=True))
    buf.zero_()
    shifted = torch.randn(5001, generator=g, device="cuda").bfloat16()[1:]  # 2-byte aligned
    odd = [shifted, *tensors[1:]]
    assert not layout._pack_kernel(odd, None)  # its slot copies 8-byte units: falls back
    layout.pack(odd)
    assert all(torch.equal(v, t) for (_, v), t in zip(layout.unpack(), odd, strict=True))


def test_pack_kernel_moves_16_byte_words_only_from_16_byte_aligned_sources() -> None:
    """Slots and sizes in 16-byte multiples let the kernel move 16-byte words; a source that is
    only 8-byte aligned still takes the one-launch path, in 8-byte words, and is copied right,
    by the first launch and by the replays of its CUDA graph."""
    from common.packing import BucketLayout
    from common.plan import TensorSpec

    g = torch.Generator(device="cuda").manual_seed(1)
    tensors = [torch.randn(n, generator=g, device="cuda").to(dt)
               for n, dt in [(4096, torch.float32), (8192, torch.bfloat16), (1000, torch.float32)]]
    specs = [TensorSpec.of(f"t{i}", t) for i, t in enumerate(tensors)]
    plan = RefitPlan.build(specs, RefitConfig(bucket_bytes=1 << 20))
    (bucket,) = plan.buckets
    buf = torch.zeros(bucket.nbytes, dtype=torch.uint8, device="cuda")
    layout = BucketLayout(buf, specs, bucket.offsets)
    ((_, kernel),) = layout.kernels
    assert (kernel.unit, kernel.vec) == (8, 2)
    for sources in (tensors, [tensors[0], tensors[1],  # 8 bytes past a 512-byte block start
                              torch.randn(1002, generator=g, device="cuda")[2:]]):
        assert sources[-1].data_ptr() % 16 == (0 if sources is tensors else 8)
        for _ in range(2):  # a launch, then the replay of its CUDA graph
            buf.zero_()
            assert layout._pack_kernel(sources, None)
            got = layout.unpack()
            assert all(torch.equal(v, t) for (_, v), t in zip(got, sources, strict=True))
    assert set(kernel.graphs) == {1, 2} and all(kernel.graphs.values())


def test_warm_compiles_and_captures_without_changing_the_buffer() -> None:
    """The sender warms each bucket's kernels at setup by copying every slot onto itself: the
    buffer's bytes stay as they were and the graph is ready for the first refit."""
    from common.packing import BucketLayout
    from common.plan import TensorSpec

    specs = [TensorSpec(f"t{i}", (n,), torch.bfloat16) for i, n in enumerate([4096, 77, 8192])]
    plan = RefitPlan.build(specs, RefitConfig(bucket_bytes=1 << 20))
    (bucket,) = plan.buckets
    buf = torch.randint(0, 256, (bucket.nbytes,), dtype=torch.uint8, device="cuda")
    before = buf.clone()
    layout = BucketLayout(buf, specs, bucket.offsets)
    layout.warm()
    assert torch.equal(buf, before)
    assert all(k.graphs.get(k.vec) is not None for _, k in layout.kernels)


def test_back_to_back_packs_of_one_bucket_with_the_stream_busy() -> None:
    """The pointer table goes up through a pinned staging table that the next pack of the same
    bucket rewrites, and a replayed CUDA graph reads it only when it runs: with the stream busy,
    each pack must still copy its own sources (the `uploaded` event guard; without it the second
    pack's pointers reach the first pack's copy)."""
    from common.packing import BucketLayout
    from common.plan import TensorSpec

    rows = torch.arange(2_000, dtype=torch.float32, device="cuda")[:, None].expand(-1, 64)
    a, b = list((rows + 1).unbind(0)), list((-rows - 1).unbind(0))
    specs = [TensorSpec.of(f"t{i}", t) for i, t in enumerate(a)]
    plan = RefitPlan.build(specs, RefitConfig(bucket_bytes=16 << 20))
    (bucket,) = plan.buckets
    buf = torch.zeros(bucket.nbytes, dtype=torch.uint8, device="cuda")
    layout = BucketLayout(buf, specs, bucket.offsets)
    layout.pack(b)  # the first pack launches and captures; the next ones replay
    torch.cuda._sleep(500_000_000)  # keep the stream busy: a's replay waits behind this
    layout.pack(a)
    snapshot = buf.clone()  # stream-ordered after a's kernel
    layout.pack(b)
    got = BucketLayout(snapshot, specs, bucket.offsets).unpack()
    assert all(torch.equal(v, t) for (_, v), t in zip(got, a, strict=True))
    assert all(torch.equal(v, t) for (_, v), t in zip(layout.unpack(), b, strict=True))


def test_scatter_kernel_copies_every_run_bit_for_bit_and_refuses_a_misaligned_destination():
    """The direct apply's CUDA path: byte runs of one received bucket into many params, runs of
    every copy unit (8/4/2/1 bytes, 16-byte words where aligned), twice (graph replay), then
    into a destination moved off its unit's alignment."""
    import numpy as np

    from common.in_vllm.load_map import BucketCopy

    g = torch.Generator(device="cuda").manual_seed(0)
    buf = torch.randint(0, 255, (1 << 20,), dtype=torch.uint8, device="cuda", generator=g)
    runs = [(0, 0, 0, 4096), (4096, 1, 64, 3000), (8192, 1, 4000, 7), (9000, 2, 2, 6),
            (16384, 3, 0, 500_000), (600_000, 2, 100, 1),
            (700_000, 0, 5000, 12)]  # (source offset, destination, its offset, bytes)
    src, dest, dst, n = (np.array(c, dtype=np.int64) for c in zip(*runs, strict=True))
    copy = BucketCopy(src, dest, dst, n)
    params = [torch.zeros(600_000, dtype=torch.uint8, device="cuda") for _ in range(4)]
    bases = np.array([p.data_ptr() for p in params], dtype=np.int64)
    for _ in range(2):
        for p in params:
            p.zero_()
        copy.run(buf, bases)
        torch.cuda.synchronize()
        want = [torch.zeros_like(p) for p in params]
        for s, d, o, k in runs:
            want[d][o:o + k] = buf[s:s + k]
        assert all(torch.equal(p, w) for p, w in zip(params, want, strict=True))
    assert sorted(k.unit for k, _ in copy._cuda_kernels(buf)) == [1, 2, 4, 8]
    with pytest.raises(RuntimeError, match="not aligned to its 8-byte copy unit"):
        copy.run(buf, bases + 1)


def _reference_hash(payload: torch.Tensor) -> int:
    """`common.kernels.hash_kernel`'s sum in plain torch int64 ops (words, then the tail bytes)."""
    from common.kernels.hash_kernel import GOLDEN

    whole = payload.numel() // 4
    words = payload[: whole * 4].clone().view(torch.int32).to(torch.int64)
    values = torch.cat([words, payload[whole * 4:].to(torch.int64)])
    index = torch.arange(values.numel(), dtype=torch.int64, device=payload.device)
    mult = ((index ^ (index >> 29)) * GOLDEN) | 1
    return int(((values + 1) * mult).sum().item()) % (1 << 64)


def test_cuda_checksum_covers_every_byte_and_its_position() -> None:
    from common.wire import checksum

    g = torch.Generator(device="cuda").manual_seed(3)
    base = torch.randint(0, 256, (1 << 22,), dtype=torch.uint8, device="cuda", generator=g)
    for payload in (base, base[: (1 << 20) + 3], base[1: 70_001]):  # whole, tail, misaligned
        value = checksum.compute(payload)
        assert value == _reference_hash(payload.contiguous())
        flipped = payload.clone()
        flipped[-1] ^= 1
        assert checksum.compute(flipped) != value, "the last byte flipped"
        swapped = payload.clone()
        swapped[[10, 4000]] = payload[[4000, 10]]
        assert payload[10] != payload[4000] and checksum.compute(swapped) != value, "a swap"


def test_a_cuda_refit_stamps_each_bucket_header_with_its_payload_hash() -> None:
    """NCCL, world size 1 (the sender's side), eager frames (graph replay: the graph_send
    tests): checksum on, every bucket still in a buffer carries the hash of the bytes it
    holds, computed on the device without a host sync."""
    from common.wire import checksum
    from common.wire.bucket_header import HEADER_BYTES, Header

    group = RefitGroup(host="127.0.0.1", port=free_port(), rank=0, world_size=1,
                       num_trainers=1, timeout_s=60)
    try:
        source = GatheringSource(model(1))
        plan = RefitPlan.build(source.plan_specs(), RefitConfig(bucket_bytes=32 * MIB,
                                                                checksum=True,
                                                                graph_send=False))
        sender = RefitSender.setup(group, plan)
        assert sender.checksums
        sender.refit(source, 1)
        torch.cuda.synchronize()
        packed = [b for b in plan.buckets if not b.direct]
        last = {b.index % sender.num_buffers: b for b in packed}.values()  # still in a buffer
        assert len(last) == sender.num_buffers
        for bucket in last:
            header = Header.decode(sender.bucket_buffer(bucket)[:HEADER_BYTES].cpu())
            assert header.bucket == bucket.index and header.checksummed
            assert header.checksum == checksum.compute(sender.payload(bucket))
    finally:
        group.destroy()


class OddSource(GatheringSource):
    """Yields tensor `odd` from an address 8 bytes past 16-byte alignment (the pack kernel's
    16-byte variant cannot take it), the rest as fresh copies."""

    def __init__(self, tensors, odd: str) -> None:
        super().__init__(tensors)
        self.odd = odd

    def iter_tensors(self, plan):
        for name, tensor in super().iter_tensors(plan):
            if name == self.odd:
                raw = torch.empty(tensor.numel() * tensor.element_size() + 8, dtype=torch.uint8,
                                  device=tensor.device)
                tensor = raw[8:].view(tensor.dtype).view(tensor.shape).copy_(tensor)
            yield name, tensor


@pytest.mark.parametrize("checksum", [False, True])
def test_graph_send_replays_each_frame_bit_for_bit(checksum: bool) -> None:
    """NCCL, world size 1: with `graph_send` every packed bucket is one captured graph (pack,
    header, checksum, broadcast); the frames still in the buffers after a second refit hold
    its bytes, header and checksum; a source the captured kernel cannot take goes eagerly."""
    from common.wire import checksum as sums
    from common.wire.bucket_header import HEADER_BYTES, Header

    group = RefitGroup(host="127.0.0.1", port=free_port(), rank=0, world_size=1,
                       num_trainers=1, timeout_s=60)
    try:
        versions = [model(v) for v in range(3)]
        config = RefitConfig(bucket_bytes=32 * MIB, checksum=checksum, graph_send=True)
        plan = RefitPlan.build(GatheringSource(versions[0]).plan_specs(), config)
        sender = RefitSender.setup(group, plan)
        packed = [b for b in plan.buckets if not b.direct]
        for v in (1, 2):
            sender.refit(GatheringSource(versions[v]), v)
            assert sender.graphs.failure is None, sender.graphs.failure
            assert (sender.graphs.captured, sender.graphs.replays) == (len(packed),
                                                                        v * len(packed))
        torch.cuda.synchronize()
        for bucket in {b.index % sender.num_buffers: b for b in packed}.values():
            header = Header.decode(sender.bucket_buffer(bucket)[:HEADER_BYTES].cpu())
            assert (header.bucket, header.version, header.checksummed) == (bucket.index, 2,
                                                                           checksum)
            if checksum:
                assert header.checksum == sums.compute(sender.payload(bucket))
            for name, got in sender.layouts[bucket.index].unpack():
                assert torch.equal(got, versions[2][name]), name
        last = packed[-1]
        odd = plan.bucket_specs(last)[-1].name
        sender.refit(OddSource(versions[1], odd), 3)  # the last bucket eagerly
        torch.cuda.synchronize()
        assert sender.graphs.replays == 3 * len(packed) - 1
        header = Header.decode(sender.bucket_buffer(last)[:HEADER_BYTES].cpu())
        assert (header.bucket, header.version) == (last.index, 3)
        for name, got in sender.layouts[last.index].unpack():
            assert torch.equal(got, versions[1][name]), name
    finally:
        group.destroy()


def test_graph_send_stages_addresses_once_and_again_after_an_eager_pack() -> None:
    """A dict source's tensors stay put: from the second refit each replay finds its staging
    tables as they are (no rewrite, no wait) and still copies the values they hold now; an
    eager pack of a bucket (a source the captured variant cannot take) stages other addresses
    in the same tables, and the next replay stages the dict's again. Closed, the sender's
    graphs go at once; a sender set up again on the same plan sends by replay of its own."""
    from common.source import DictWeightSource

    group = RefitGroup(host="127.0.0.1", port=free_port(), rank=0, world_size=1,
                       num_trainers=1, timeout_s=60)
    try:
        weights = model(0)
        source = DictWeightSource(weights)
        plan = RefitPlan.build(source.plan_specs(), RefitConfig(bucket_bytes=32 * MIB,
                                                                 graph_send=True))
        sender = RefitSender.setup(group, plan)
        packed = [b for b in plan.buckets if not b.direct]
        kept = {b.index % sender.num_buffers: b for b in packed}.values()  # still in a buffer

        def holds(version: int) -> None:
            torch.cuda.synchronize()
            for bucket in kept:
                for name, got in sender.layouts[bucket.index].unpack():
                    assert torch.equal(got, weights[name]), (version, name)

        def uploads() -> int:
            return sum(k.ptrs.uploads for b in packed for _, k in sender.layouts[b.index].kernels)

        sender.refit(source, 1)
        first = uploads()
        assert first >= len(packed)
        for t in weights.values():
            t.neg_()  # new values at the same addresses
        sender.refit(source, 2)
        assert uploads() == first  # no table went up again
        holds(2)
        sender.refit(OddSource(weights, plan.bucket_specs(packed[-1])[-1].name), 3)
        holds(3)
        odd = uploads()
        assert odd > first  # the eager pack staged other addresses
        for t in weights.values():
            t.add_(1)
        sender.refit(source, 4)
        assert uploads() > odd  # and the replay staged the dict's again
        holds(4)
        assert sender.graphs.replays == 4 * len(packed) - 1
        kernels = [k for b in packed for _, k in sender.layouts[b.index].kernels]
        assert all(k.graphs for k in kernels)
        sender.close()  # the graphs go now; a sender set up again captures its own
        assert sender.graphs is None and not any(k.graphs for k in kernels)
        again = RefitSender.setup(group, plan)
        again.refit(source, 5)
        torch.cuda.synchronize()
        for bucket in {b.index % again.num_buffers: b for b in packed}.values():
            for name, got in again.layouts[bucket.index].unpack():
                assert torch.equal(got, weights[name]), name
        assert again.graphs.replays == len(packed)
    finally:
        group.destroy()


def test_graph_send_launches_runs_of_frames_in_order() -> None:
    """With 2 buffers a graph launch carries up to 3 frames of a dict's tensors, a refit's runs
    growing 1, 1, 2, 3; the buffers end holding the last frames, bit for bit, with
    their headers. A frame that goes eagerly launches the pending run first: bucket 2, pending when
    bucket 3 goes eagerly, is in its buffer before bucket 3 is, both bit for bit.
    A source's own copies (freed after the send) launch frame by frame."""
    from common.source import DictWeightSource
    from common.wire.bucket_header import HEADER_BYTES, Header

    group = RefitGroup(host="127.0.0.1", port=free_port(), rank=0, world_size=1,
                       num_trainers=1, timeout_s=60)
    try:
        g = torch.Generator(device="cuda").manual_seed(0)
        weights = {f"w{i}": torch.randn(512 * 1024, generator=g, device="cuda").bfloat16()
                   for i in range(16)}  # 1 MiB each, 4 a bucket
        source = DictWeightSource(weights)
        plan = RefitPlan.build(source.plan_specs(), RefitConfig(
            bucket_bytes=4 * MIB + 4096, num_buffers=2, graph_send=True))
        assert [len(plan.bucket_specs(b)) for b in plan.buckets] == [4] * 4
        sender = RefitSender.setup(group, plan)

        def holds(version: int, buckets: list[int], tensors: dict) -> None:
            torch.cuda.synchronize()
            for index in buckets:
                bucket = plan.buckets[index]
                header = Header.decode(sender.bucket_buffer(bucket)[:HEADER_BYTES].cpu())
                assert (header.bucket, header.version) == (index, version)
                for name, got in sender.layouts[index].unpack():
                    assert torch.equal(got, tensors[name]), (version, name)

        for version in (1, 2):
            sender.refit(source, version)
            assert sender.graphs.launches == 3 * version  # [0], [1], [2, 3]
            holds(version, [2, 3], weights)
        odd, name = dict(weights), plan.bucket_specs(plan.buckets[3])[-1].name
        raw = torch.empty(weights[name].numel() * 2 + 8, dtype=torch.uint8, device="cuda")
        odd[name] = raw[8:].view(torch.bfloat16).copy_(weights[name])  # not 16-byte aligned
        sender.refit(DictWeightSource(odd), 3)  # [0], [1], [2], then bucket 3 eagerly
        assert (sender.graphs.launches, sender.graphs.replays) == (9, 11)
        holds(3, [2, 3], odd)
        sender.refit(OddSource(weights, name), 4)  # a source's copies: each frame at once
        assert (sender.graphs.launches, sender.graphs.replays) == (12, 14)
        holds(4, [2, 3], weights)
        for t in weights.values():
            t.neg_()
        sender.refit(source, 5)
        assert sender.graphs.launches == 15
        holds(5, [2, 3], weights)
    finally:
        group.destroy()


def staged_rank(rank: int, world: int, port: int, buffers: int) -> dict:
    """A host (gloo) group whose receiver applies on the GPU: frames staged from page-locked
    buffers, asynchronously, while the next frames land in the other buffers."""
    from common.source import DictWeightSource
    from common.transfer.sender import RefitReceiver
    from tests.test_roundtrip import bits, make_tensors

    config = RefitConfig(bucket_bytes=16 << 10, num_buffers=buffers, timeout_s=60,
                         direct_bytes=2 << 10)
    group = RefitGroup(host="127.0.0.1", port=port, rank=rank, world_size=world, device="cpu",
                       num_trainers=1, timeout_s=60)
    if group.is_trainer:
        source = DictWeightSource(make_tensors(0))
        sender = RefitSender.setup(group, RefitPlan.build(source.plan_specs(), config))
        for version in (1, 2, 3):
            source.tensors = make_tensors(0, version)
            sender.refit(source, version)
        return {}
    receiver = RefitReceiver.setup(group)
    receiver.stage_onto(torch.device("cuda", 0))
    assert all(b.is_pinned() for b in receiver.buffers)
    out = {}
    for version in (1, 2, 3):
        got: dict = {}
        stats = receiver.receive(lambda items, got=got: got.update(
            {n: t.clone() for n, t in items}), on_done=lambda: None)  # on_done: spans taken
        torch.cuda.synchronize()
        want = make_tensors(0, version)
        assert all(t.device.type == "cuda" for t in got.values())
        differ = [n for n, w in want.items() if not torch.equal(bits(got[n]).cpu(), bits(w))]
        assert not differ, f"v{version}: {differ}"
        out[version] = stats.device_stage_s
    return out


@pytest.mark.parametrize("buffers", [1, 2])
def test_host_group_stages_frames_onto_the_gpu_from_page_locked_buffers(buffers: int) -> None:
    """Every refit's bytes land on the GPU bit for bit, though each staging copy is queued
    and the host buffer it reads takes the next frames only once it finished."""
    got = expect_ok(run_ranks(staged_rank, 2, buffers))[1]
    assert all(seconds > 0 for seconds in got.values()), got


def staged_compact_rank(rank: int, world: int, port: int) -> dict:
    """Shard-to-shard under host staging: rank 1 reads half of every tensor (compact frames,
    from page-locked compact buffers), rank 2 every byte; both apply on the GPU."""
    import numpy as np

    from common.source import DictWeightSource
    from common.transfer.sender import RefitReceiver
    from tests.test_shard_core import CONFIG, bucket_image, needs_for, split_tensors

    group = RefitGroup(host="127.0.0.1", port=port, rank=rank, world_size=world, device="cpu",
                       num_trainers=1, timeout_s=60)
    if group.is_trainer:
        sender = RefitSender.setup(group, RefitPlan.build(
            DictWeightSource(split_tensors(1)).plan_specs(), CONFIG))
        for version in (1, 2, 3):
            sender.refit(DictWeightSource(split_tensors(version)), version)
        return {}
    receiver = RefitReceiver.setup(group)
    receiver.stage_onto(torch.device("cuda", 0))
    plan = receiver.plan
    if rank == 1:
        receiver.needs = needs_for(plan, 0)
    out = {}
    for version in (1, 2, 3):
        want, checked = split_tensors(version), []

        def whole(items: list, want: dict = want, checked: list = checked) -> None:
            for name, got in items:
                assert torch.equal(got.reshape(-1).view(torch.uint8).cpu(),
                                   want[name].contiguous().reshape(-1).view(torch.uint8)), name
            checked.append(len(items))

        def compact(index: int, payload: torch.Tensor, want: dict = want,
                    checked: list = checked) -> None:
            assert payload.is_cuda
            ranges, got = receiver.needs.buckets[index], payload.cpu().numpy()
            image = bucket_image(plan, index, want)
            for place, start, length in zip(ranges.placed(), ranges.starts, ranges.lengths,
                                            strict=True):
                assert np.array_equal(got[place : place + length],
                                      image[start : start + length]), (index, start)
            checked.append(1)

        stats = receiver.receive(whole, on_compact=compact, version=version)
        out[version] = {"need_set": stats.need_set, "checked": len(checked),
                        "pinned": all(b.is_pinned() for c in receiver.compact.values()
                                      for b in c.buffers)}
    return out


def test_host_staged_compact_frames_come_from_page_locked_buffers_bit_for_bit() -> None:
    from common.source import DictWeightSource
    from tests.test_shard_core import CONFIG, split_tensors

    res = expect_ok(run_ranks(staged_compact_rank, 3))
    buckets = len(RefitPlan.build(DictWeightSource(split_tensors(1)).plan_specs(),
                                  CONFIG).buckets)
    assert all(r["checked"] == buckets for rank in (1, 2) for r in res[rank].values()), res
    assert res[1][3]["need_set"] != res[2][3]["need_set"] and res[1][3]["pinned"], res
