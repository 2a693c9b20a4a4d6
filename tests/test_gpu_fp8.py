"""The one-pass CUDA block-FP8 quantizer (`common.kernels.fp8_kernel`) against torch's own ops on
the same device, which are what vLLM's `per_block_cast_to_fp8` runs eagerly (and against that
function itself where vLLM is importable): bit for bit, odd shapes, zeros, extremes, strided
inputs, UE8M0 scales, NaN refused (skipped on CPU)."""

from __future__ import annotations

import pytest
import torch

from common.kernels import fp8_kernel
from common.quant.fp8_batch import quantize_batch
from common.quant.fp8_blocks import BlockFp8Format, _quantize_in_chunks, quantize

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
SHAPES = [(128, 128), (256, 384), (1, 1), (1, 300), (300, 1), (129, 257), (1000, 130),
          (4096, 7168)]


def same(x: torch.Tensor, fmt: BlockFp8Format) -> None:
    assert fp8_kernel.available(x, fmt.block)
    q, s = quantize("w", x, fmt)
    rq, rs = _quantize_in_chunks(x, fmt, 1 << 23)
    assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8))
    assert torch.equal(s.view(torch.int32), rs.view(torch.int32))


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("ue8m0", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fp8_cuda_kernel_equals_torch_on_cuda(shape, ue8m0, dtype) -> None:
    g = torch.Generator(device="cuda").manual_seed(sum(shape))
    x = (torch.randn(shape, generator=g, device="cuda") * 3).to(dtype)
    same(x, BlockFp8Format(ue8m0=ue8m0))
    same(x, BlockFp8Format((64, 32), ue8m0=ue8m0))


@pytest.mark.parametrize("ue8m0", [False, True])
def test_fp8_cuda_kernel_zeros_extremes_and_strides(ue8m0) -> None:
    fmt = BlockFp8Format(ue8m0=ue8m0)
    x = torch.randn(300, 300, device="cuda").bfloat16()
    x[:128, :128] = 0  # an all-zero block: the clamped scale
    x[128:256, :128] = torch.finfo(torch.bfloat16).max / 2
    x[256:, 128:] *= 1e-30  # subnormal e4m3 values after scaling
    same(x, fmt)
    same(x.t(), fmt)  # strided: read through its strides
    same(torch.randn(1 + 256 * 384, device="cuda").bfloat16()[1:].view(256, 384), fmt)  # 2 B
    same(torch.zeros(5, 7, device="cuda", dtype=torch.bfloat16), fmt)


def test_fp8_cuda_batch_one_launch_per_shape_equals_each_alone() -> None:
    """An MoE bucket: many experts of two shapes (one of them at an address 2 bytes past a
    16-byte boundary: its group loads narrower), a strided one, an fp32 one, a 1-D one
    (refused), one with a NaN (refused alone, its group's others quantized)."""
    fmt = BlockFp8Format()
    g = torch.Generator(device="cuda").manual_seed(1)
    xs = [torch.randn(s, generator=g, device="cuda").bfloat16()
          for s in [(768, 2048)] * 6 + [(2048, 768)] * 5]
    xs += [torch.randn(300, 260, device="cuda").bfloat16().t(), torch.randn(129, 257,
                                                                           device="cuda")]
    xs.append(torch.randn(1 + 768 * 2048, generator=g, device="cuda").bfloat16()[1:]
              .view(768, 2048))
    xs[3][5, 9] = float("nan")
    named = [(f"experts.{i}.w", x) for i, x in enumerate(xs)] + [("norm", xs[0][0])]
    out = quantize_batch(named, fmt)
    for (name, x), got in zip(named, out, strict=True):
        if name in ("experts.3.w", "norm"):
            assert isinstance(got, str) and got.startswith(name), got
            continue
        rq, rs = _quantize_in_chunks(x, fmt, 1 << 23)
        assert torch.equal(got[0].view(torch.uint8), rq.view(torch.uint8)), name
        assert torch.equal(got[1].view(torch.int32), rs.view(torch.int32)), name
    assert "1 NaN and 0 inf" in out[3] and "(5, 9)" in out[3]


def test_fp8_cuda_kernel_refuses_nan_naming_the_tensor() -> None:
    x = torch.randn(300, 300, device="cuda").bfloat16()
    x[200, 7] = float("nan")
    with pytest.raises(ValueError, match=r"experts.3.w: 1 NaN and 0 inf .* first at \(200, 7\)"):
        quantize("experts.3.w", x, BlockFp8Format())


def test_fp8_cuda_kernel_equals_vllms_reference_where_importable() -> None:
    deep_gemm = pytest.importorskip("vllm.utils.deep_gemm")
    x = torch.randn(1000, 1030, device="cuda").bfloat16()
    for ue8m0 in (False, True):
        q, s = quantize("w", x, BlockFp8Format(ue8m0=ue8m0))
        with torch.compiler.set_stance("force_eager"):
            rq, rs = deep_gemm.per_block_cast_to_fp8(x, [128, 128], use_ue8m0=ue8m0)
        assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8))
        assert torch.equal(s.view(torch.int32), rs.view(torch.int32))


@pytest.mark.parametrize("graph_send", [False, True])
def test_fp8_cuda_frames_by_address_hold_the_quantizers_bytes(graph_send: bool) -> None:
    """NCCL, world size 1: buckets quantized by the kernel go to the sender by address and its
    frames (eager, or each one a graph replay) hold the quantizer's bytes."""
    from tests.fp8_frames import frames_hold_the_quantizers_bytes

    assert frames_hold_the_quantizers_bytes("cuda", graph_send) > 0
