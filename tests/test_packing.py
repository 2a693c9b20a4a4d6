"""Packing and unpacking: mixed dtypes, strides, 0-d and empty tensors, zero-copy views."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from common.config import RefitConfig
from common.kernels import native
from common.packing import BucketLayout, first_differing, pack, unpack
from common.plan import RefitPlan, TensorSpec
from common.source import PreparedBucket

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def mixed(device: str) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    t = {
        "bf16": torch.randn(7, 5, generator=g).bfloat16(),
        "fp16": torch.randn(3, generator=g).half(),
        "fp32_scalar": torch.randn((), generator=g),
        "int64": torch.randint(-(2**60), 2**60, (5,), generator=g),
        "bool": torch.rand(11, generator=g) > 0.5,
        "empty": torch.empty(0, 3, dtype=torch.bfloat16),
        "transposed": torch.randn(6, 4, generator=g).t(),
        "strided": torch.randn(10, generator=g)[::3],
        "uint8": torch.randint(0, 255, (9,), dtype=torch.uint8, generator=g),
        "neg_view": torch._neg_view(torch.randn(6, generator=g)),  # lazy sign bit: not raw bytes
    }
    return {k: v.to(device) for k, v in t.items()}


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.resolve_neg().contiguous().reshape(-1).view(torch.uint8)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("alignment", [1, 4, 256])
def test_pack_unpack_bitwise(device: str, alignment: int) -> None:
    tensors = mixed(device)
    plan = RefitPlan.build([TensorSpec.of(n, t) for n, t in tensors.items()],
                           RefitConfig(bucket_bytes=1 << 20, alignment=alignment))
    (bucket,) = plan.buckets
    buf = torch.full((bucket.nbytes,), 0xAB, dtype=torch.uint8, device=device)
    pack(buf, plan.bucket_specs(bucket), bucket.offsets, list(tensors.values()))
    views = unpack(buf, plan.bucket_specs(bucket), bucket.offsets)
    assert [n for n, _ in views] == list(tensors)
    lo, hi = buf.data_ptr(), buf.data_ptr() + buf.numel()
    copies = 0
    for (name, view), want in zip(views, tensors.values(), strict=True):
        assert view.dtype == want.dtype and view.shape == want.shape, name
        assert torch.equal(bits(view), bits(want)), name
        if view.numel():
            copies += not lo <= view.data_ptr() < hi
    if alignment == 256:
        assert copies == 0  # every view aliases the buffer
    else:
        assert copies <= 6  # only misaligned multi-byte dtypes are copied


@pytest.mark.parametrize("device", DEVICES)
def test_many_small_tensors_in_one_call(device: str) -> None:
    tensors = [torch.randn(33, device=device).bfloat16() for _ in range(2000)]
    specs = [TensorSpec.of(f"e{i}", t) for i, t in enumerate(tensors)]
    plan = RefitPlan.build(specs, RefitConfig(bucket_bytes=1 << 20))
    (bucket,) = plan.buckets
    buf = torch.empty(bucket.nbytes, dtype=torch.uint8, device=device)
    pack(buf, specs, bucket.offsets, tensors)
    assert all(torch.equal(v, t) for (_, v), t in zip(unpack(buf, specs, bucket.offsets),
                                                          tensors, strict=True))


@pytest.mark.parametrize("device", DEVICES)
def test_adjacent_slots_of_one_dtype(device: str) -> None:
    """Back-to-back slots (CPU: one `torch.cat` per run) with N-d, strided and 0-d sources."""
    g = torch.Generator().manual_seed(5)
    tensors = [torch.randn(4, 64, generator=g), torch.randn(8, 32, generator=g).t(),
               torch.randn((), generator=g), torch.randn(96, generator=g)[::3],
               torch.randn(64, generator=g), torch.randn(3, 64, generator=g).half(),
               torch.randn(64, generator=g).half(), torch.randn(64, generator=g)]
    tensors = [t.to(device) for t in tensors]
    specs = [TensorSpec.of(f"t{i}", t) for i, t in enumerate(tensors)]
    plan = RefitPlan.build(specs, RefitConfig(bucket_bytes=1 << 20, alignment=4))
    (bucket,) = plan.buckets
    buf = torch.zeros(bucket.nbytes, dtype=torch.uint8, device=device)
    layout = BucketLayout(buf, specs, bucket.offsets)
    if device == "cpu":  # fp32 #0-4 and fp16 #5-6 are runs; the last fp32 stands alone
        assert [(lo, hi) for lo, hi, _ in layout.runs] == [(0, 5), (5, 7)]
    layout.pack(tensors)
    for (name, view), want in zip(layout.unpack(), tensors, strict=True):
        assert view.shape == want.shape and torch.equal(view, want), name


def test_first_differing_tensor_skips_the_alignment_padding() -> None:
    specs = [TensorSpec("a", (3,), torch.uint8), TensorSpec("b", (5,), torch.uint8)]
    offsets = [0, 8]  # a: bytes 0-2, padding 3-7, b: bytes 8-12
    base = torch.arange(13, dtype=torch.uint8)
    other = base.clone()
    other[5] += 1  # padding only
    assert first_differing(specs, offsets, base, other) is None
    other[12] += 1  # b's last byte
    assert first_differing(specs, offsets, base, other) == 1
    other[0] += 1
    assert first_differing(specs, offsets, base, other) == 0


@pytest.mark.parametrize("device", DEVICES)
def test_staged_views_made_once_per_staging_buffer(device: str) -> None:
    """Host staging: each bucket's views into the reused staging buffer are made once (the
    same view objects each refit, reading whatever the buffer holds now) and made anew
    when the buffer moves; a receiver's layouts never build pack kernels."""
    from common.transfer.apply_device import ApplyDevice

    specs = [TensorSpec(f"w{i}", (4, 8), torch.bfloat16) for i in range(6)]
    plan = RefitPlan.build(specs, RefitConfig(bucket_bytes=1024))
    first, second = plan.buckets[:2]
    staging, apply = torch.empty(4096, dtype=torch.uint8, device=device), ApplyDevice()
    for fill in (1.0, 2.0):
        staging.view(torch.bfloat16).fill_(fill)
        views = apply.staged_views(first, staging[: first.nbytes], plan)
        assert [n for n, _ in views] == [s.name for s in plan.bucket_specs(first)]
        assert all(bool((v == fill).all()) for _, v in views)
    again = apply.staged_views(first, staging[: first.nbytes], plan)
    assert all(a is b for (_, a), (_, b) in zip(views, again, strict=True))
    other = apply.staged_views(second, staging[: second.nbytes], plan)
    assert [n for n, _ in other] == [s.name for s in plan.bucket_specs(second)]
    moved = torch.zeros(8192, dtype=torch.uint8, device=device)  # the buffer grew elsewhere
    views = apply.staged_views(first, moved[: first.nbytes], plan)
    assert all(v.data_ptr() >= moved.data_ptr() and bool((v == 0).all()) for _, v in views)
    assert all(layout._built_kernels is None for layout in apply._layouts.values())


def test_kernel_tables_split_the_addresses_per_kernel_and_refuse_a_misaligned_source() -> None:
    """The pack and the graph send's shared split of a bucket's source addresses: each
    pointer-table kernel's slice and its alignment bits; None when a source is off its
    kernel's copy unit."""
    from types import SimpleNamespace

    from common.packing import kernel_tables

    wide, narrow = SimpleNamespace(unit=8), SimpleNamespace(unit=2)
    ptrs = np.array([4096, 4112, 4098, 8192], dtype=np.int64)
    tables = kernel_tables([(np.array([0, 1, 3]), wide), (np.array([2]), narrow)], ptrs)
    assert [(k, t.tolist(), bits) for k, t, bits in tables] == [
        (wide, [4096, 4112, 8192], 4096 | 4112 | 8192), (narrow, [4098], 4098)]
    assert kernel_tables([(None, wide)], ptrs) is None  # 4098 is not 8-byte aligned
    assert kernel_tables([(None, narrow)], ptrs)[0][2] == int(np.bitwise_or.reduce(ptrs))


@pytest.mark.parametrize("device", DEVICES)
def test_fill_lets_the_source_write_its_slots_and_copies_the_rest(device: str) -> None:
    """`BucketLayout.fill`: the source's fill gets every slot's address and the mark, writes
    the slots it names; the layout copies the others from `ptrs` (the native loop on CPU, the
    pack kernel on CUDA). A layout with a misaligned slot declines (None): the caller packs."""
    if device == "cpu" and native.load() is None:
        pytest.skip("no native module")
    tensors = {n: t.contiguous() for n, t in mixed(device).items()
               if n not in ("neg_view", "empty")}
    specs = [TensorSpec.of(n, t) for n, t in tensors.items()]
    plan = RefitPlan.build(specs, RefitConfig(bucket_bytes=1 << 20))
    (bucket,) = plan.buckets
    buf = torch.zeros(bucket.nbytes, dtype=torch.uint8, device=device)
    layout = BucketLayout(buf, plan.bucket_specs(bucket), bucket.offsets)
    values = list(tensors.values())
    filled, seen = np.array([0, 3], dtype=np.int64), []

    def fill(slots: np.ndarray, mark: tuple[int, int]):
        seen.append((slots.copy(), mark))
        for k in filled.tolist():  # as a kernel would: straight into the slot
            n = values[k].nbytes
            buf[bucket.offsets[k]:bucket.offsets[k] + n].copy_(bits(values[k]))
        return lambda: None

    ptrs = np.array([t.data_ptr() for t in values], dtype=np.int64)
    ptrs[filled] = 0  # the filled slots' addresses are the source's business
    prepared = PreparedBucket(tuple(tensors), ptrs, lambda: values, buf.device, (), fill, filled)
    check = layout.fill(prepared, (1234, 3))
    assert check is not None and check() is None
    (slots, mark), = seen
    assert mark == (1234, 3) and slots.tolist() == [buf.data_ptr() + o for o in bucket.offsets]
    for (name, view), want in zip(layout.unpack(), values, strict=True):
        assert torch.equal(bits(view), bits(want)), name
    odd = RefitPlan.build(specs, RefitConfig(bucket_bytes=1 << 20, alignment=1)).buckets[0]
    misaligned = BucketLayout(torch.zeros(odd.nbytes, dtype=torch.uint8, device=device),
                              plan.bucket_specs(bucket), odd.offsets)
    assert misaligned.misaligned and misaligned.fill(prepared, (1234, 3)) is None
