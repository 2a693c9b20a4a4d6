"""The trainer-side block-FP8 quantizer against vLLM's own `per_block_cast_to_fp8`, byte for byte.

vLLM wraps that function in `torch.compile(dynamic=True)`: every new dtype, flag or size-1 dim
costs a recompile of seconds on CPU (and after 8 it falls back to eager anyway). The grid runs
vLLM's function body eagerly (`set_stance("force_eager")`); one slow test runs it compiled.
"""

from __future__ import annotations

import pytest
import torch

from common.quant.fp8_blocks import BlockFp8Format, dequantize, quantize

BF16_MAX = torch.finfo(torch.bfloat16).max


@pytest.fixture(scope="module")
def vllm_cast():
    from vllm.utils.deep_gemm import per_block_cast_to_fp8

    return per_block_cast_to_fp8


def reference(cast, x: torch.Tensor, fmt: BlockFp8Format, compiled: bool = False):
    if compiled:
        return cast(x, list(fmt.block), use_ue8m0=fmt.ue8m0)
    with torch.compiler.set_stance("force_eager"):
        return cast(x, list(fmt.block), use_ue8m0=fmt.ue8m0)


def assert_same(cast, x: torch.Tensor, fmt: BlockFp8Format, compiled: bool = False,
                **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    q, s = quantize("w", x, fmt, **kwargs)
    rq, rs = reference(cast, x, fmt, compiled)
    assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float32
    assert q.shape == x.shape and tuple(s.shape) == fmt.scale_shape(x.shape) == tuple(rs.shape)
    assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8))
    assert torch.equal(s.view(torch.int32), rs.view(torch.int32))
    nan_bytes = (q.view(torch.uint8) & 0x7F) == 0x7F  # e4m3fn has no inf; 0x7f / 0xff are NaN
    assert not nan_bytes.any()
    return q, s


def weights(shape, dtype, seed: int) -> torch.Tensor:
    """Normal values whose magnitude varies by row, so blocks get very different scales."""
    g = torch.Generator().manual_seed(seed)
    rows = torch.exp(torch.randn(shape[0], 1, generator=g) * 4)
    return (torch.randn(shape, generator=g) * rows).to(dtype)


SHAPES = [(128, 128), (256, 384), (1, 1), (1, 300), (300, 1), (129, 257), (1000, 130)]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("block", [(128, 128), (64, 32)])
@pytest.mark.parametrize("ue8m0", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fp8_matches_vllm(vllm_cast, shape, block, ue8m0, dtype) -> None:
    fmt = BlockFp8Format(block=block, ue8m0=ue8m0)
    assert_same(vllm_cast, weights(shape, dtype, seed=sum(shape)), fmt)


@pytest.mark.parametrize("seed", range(6))
def test_fp8_random_seeds_and_fp16(vllm_cast, seed) -> None:
    dtype = (torch.bfloat16, torch.float16, torch.float32)[seed % 3]
    x = weights((200, 300), torch.float32, seed).clamp(-6e4, 6e4).to(dtype)
    assert_same(vllm_cast, x, BlockFp8Format(block=(32, 64), ue8m0=seed % 2 == 1))


@pytest.mark.parametrize("ue8m0", [False, True])
def test_fp8_zero_blocks_get_the_clamped_scale(vllm_cast, ue8m0) -> None:
    fmt = BlockFp8Format(ue8m0=ue8m0)
    q, s = assert_same(vllm_cast, torch.zeros(200, 300, dtype=torch.bfloat16), fmt)
    assert not q.view(torch.uint8).any() and torch.equal(s, s[0, 0].expand_as(s))
    x = weights((300, 300), torch.bfloat16, seed=1)
    x[:128, 128:256] = 0  # a whole block
    x[256:, 256:] = 0  # the partial corner block
    x[128:256, :1] = 0  # a zero column inside a block changes nothing
    q, s = assert_same(vllm_cast, x, fmt)
    clamped = torch.tensor(1e-4) / 448
    if ue8m0:
        clamped = torch.exp2(torch.ceil(torch.log2(clamped)))
    assert s[0, 1] == s[2, 2] == clamped and not q[256:, 256:].view(torch.uint8).any()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("ue8m0", [False, True])
def test_fp8_extremes(vllm_cast, dtype, ue8m0) -> None:
    fmt = BlockFp8Format(block=(16, 16), ue8m0=ue8m0)
    x = weights((64, 80), torch.float32, seed=3)
    tiny = torch.finfo(dtype).smallest_normal
    x[:16] = BF16_MAX * torch.sign(x[:16])  # at the bf16 max
    x[16:32, :16] = tiny * 0.25  # subnormal
    x[16:32, 16:32] = torch.linspace(-1e-3, 1e-3, 256).view(16, 16)  # amax beyond the clamp
    x[32:48, 32:48] = torch.linspace(-5e-5, 5e-5, 256).view(16, 16)  # amax below the clamp
    x[48:, :8] = 1e30  # huge and tiny in one block
    x[48:, 8:16] = 1e-30
    x[48:, 16:] = torch.finfo(dtype).max / 3 if dtype == torch.float32 else -3e38
    assert_same(vllm_cast, x.to(dtype), fmt)


def test_fp8_exact_448_multiples_and_rounding_ties(vllm_cast) -> None:
    """Values whose scaled form lands on e4m3 rounding midpoints and on 448 itself."""
    grid = torch.arange(-448, 449, dtype=torch.float32)
    x = torch.cat([grid, grid + 0.5, grid * 0.999, grid * 1.001])[: 28 * 128].view(28, 128)
    assert_same(vllm_cast, x, BlockFp8Format(block=(4, 128)))
    assert_same(vllm_cast, x.to(torch.bfloat16), BlockFp8Format(block=(4, 128), ue8m0=True))


@pytest.mark.parametrize("chunk_elems", [1, 3 * 64 * 130, 10**9])
def test_fp8_chunks_match_one_pass(vllm_cast, chunk_elems) -> None:
    """1: one block row per chunk; 3 block rows; everything at once. 1000 rows is 15 full
    block rows of 64 and a partial one, 130 columns 4 full blocks of 32 and a partial one."""
    x = weights((1000, 130), torch.bfloat16, seed=7)
    for ue8m0 in (False, True):
        assert_same(vllm_cast, x, BlockFp8Format(block=(64, 32), ue8m0=ue8m0),
                    chunk_elems=chunk_elems)


def test_fp8_strided_input(vllm_cast) -> None:
    x = weights((257, 384), torch.bfloat16, seed=11)
    assert_same(vllm_cast, x.t(), BlockFp8Format())
    assert_same(vllm_cast, x[:, 5:300], BlockFp8Format(block=(64, 64)), chunk_elems=1)


def test_fp8_empty_tensors_give_empty_results(vllm_cast) -> None:
    assert_same(vllm_cast, torch.zeros(0, 256, dtype=torch.bfloat16), BlockFp8Format())
    q, s = quantize("w", torch.zeros(5, 0), BlockFp8Format())  # vLLM's cannot view this one
    assert q.shape == (5, 0) and s.shape == (1, 0)


@pytest.mark.parametrize("where", [(0, 0), (130, 299), (299, 1)])
def test_fp8_refuses_nan_and_inf_naming_the_tensor(where) -> None:
    x = weights((300, 300), torch.bfloat16, seed=5)
    x[where] = float("nan")
    x[299, 299] = float("inf")
    x[200, 0] = float("-inf")
    with pytest.raises(ValueError) as err:
        quantize("model.layers.3.mlp.down_proj.weight", x, BlockFp8Format(), chunk_elems=1)
    msg = str(err.value)
    assert msg.startswith("model.layers.3.mlp.down_proj.weight: ")
    assert "1 NaN and 2 inf" in msg and f"first at {min(where, (200, 0))}" in msg


def test_fp8_refuses_other_ranks_and_dtypes() -> None:
    fmt = BlockFp8Format()
    for bad in (torch.zeros(2, 128, 128), torch.zeros(128), torch.zeros(())):
        with pytest.raises(ValueError, match=r"^experts\.w13: .*2-D"):
            quantize("experts.w13", bad, fmt)
    for dtype in (torch.float64, torch.int32, torch.float8_e4m3fn):
        with pytest.raises(ValueError, match=r"^w: .*bf16, fp16 or fp32"):
            quantize("w", torch.zeros(4, 4, dtype=dtype), fmt)


@pytest.mark.parametrize("ue8m0", [False, True])
def test_fp8_dequantize_round_trip(ue8m0) -> None:
    fmt = BlockFp8Format(block=(64, 32), ue8m0=ue8m0)
    x = weights((300, 130), torch.float32, seed=2)
    q, s = quantize("w", x, fmt)
    back = dequantize(q, s, fmt)
    # e4m3 keeps 3 mantissa bits: within 1/16 relative, plus a subnormal step of the block
    step = s.repeat_interleave(64, 0).repeat_interleave(32, 1)[:300, :130] * 2.0**-9
    assert back.dtype == torch.float32
    assert bool(((back - x).abs() <= x.abs() / 16 + step).all())
    if ue8m0:
        assert torch.equal(torch.exp2(torch.log2(s).round()), s)
    with pytest.raises(ValueError, match="scale_inv shape"):
        dequantize(q, s[:, :-1], fmt)


def test_fp8_format_basics() -> None:
    fmt = BlockFp8Format()
    assert fmt.dtype == torch.float8_e4m3fn and fmt.block == (128, 128) and not fmt.ue8m0
    assert fmt.scale_shape((7168, 18432)) == (56, 144)
    assert fmt.scale_shape(torch.Size([129, 1])) == (2, 1)
    assert fmt.describe() == "fp8 e4m3 in 128x128 blocks, float32 scales"
    assert "ue8m0" in BlockFp8Format(ue8m0=True).describe()
    assert BlockFp8Format(block=[64, 32]).block == (64, 32)
    for block in ((128,), (0, 128), (128.0, 128)):
        with pytest.raises(ValueError, match="block"):
            BlockFp8Format(block=block)


DEEPSEEK_V3 = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
               "weight_block_size": [128, 128]}


@pytest.mark.parametrize("cfg, block, ue8m0, keep", [
    (DEEPSEEK_V3, (128, 128), False, ()),
    ({**DEEPSEEK_V3, "scale_fmt": "ue8m0"}, (128, 128), True, ()),  # DeepSeek-V3.1
    ({**DEEPSEEK_V3, "modules_to_not_convert": ["lm_head", "model.layers.0.mlp.gate"]},
     (128, 128), False, ("lm_head", "model.layers.0.mlp.gate")),
    ({**DEEPSEEK_V3, "ignored_layers": ["lm_head"], "modules_to_not_convert": ["x"]},
     (128, 128), False, ("lm_head",)),  # vLLM: ignored_layers first
    ({**DEEPSEEK_V3, "ignored_layers": [], "modules_to_not_convert": ["x"]},
     (128, 128), False, ("x",)),  # an empty one falls through
    ({**DEEPSEEK_V3, "weight_block_size": [64, 32]}, (64, 32), False, ()),
])
def test_fp8_format_from_quantization_config(cfg, block, ue8m0, keep) -> None:
    from vllm.model_executor.layers.quantization.fp8 import Fp8Config

    fmt = BlockFp8Format.from_quantization_config(cfg)
    assert (fmt.block, fmt.ue8m0, fmt.keep_unquantized) == (block, ue8m0, keep)
    vllm_cfg = Fp8Config.from_config(cfg)
    assert tuple(vllm_cfg.weight_block_size) == fmt.block
    assert tuple(vllm_cfg.ignored_layers) == fmt.keep_unquantized


@pytest.mark.parametrize("cfg, match", [
    ({"quant_method": "fp8", "activation_scheme": "static"}, "per-tensor FP8"),
    ({"quant_method": "fp8", "activation_scheme": "dynamic"}, "per-tensor FP8"),
    ({"quant_method": "compressed-tensors", "config_groups": {}}, "'compressed-tensors'"),
    ({"quant_method": "awq", "bits": 4}, "'awq'"),
    ({**DEEPSEEK_V3, "activation_scheme": "static"}, "dynamic"),
    ({k: v for k, v in DEEPSEEK_V3.items() if k != "activation_scheme"}, "activation_scheme"),
    ({**DEEPSEEK_V3, "weight_block_size": [128]}, "2 dims"),
    ({**DEEPSEEK_V3, "store_dtype": "mxfp4"}, "store_dtype"),
    ({"weight_block_size": [128, 128]}, "quant_method"),
])
def test_fp8_format_refuses_other_quantizations(cfg, match) -> None:
    with pytest.raises(ValueError, match=match):
        BlockFp8Format.from_quantization_config(cfg)


def test_fp8_format_without_quantization_config_is_none() -> None:
    assert BlockFp8Format.from_quantization_config(None) is None


@pytest.mark.slow
def test_fp8_matches_compiled_vllm(vllm_cast) -> None:
    """What vLLM runs: its inductor-compiled function (two compiles, seconds each on CPU)."""
    x = weights((129, 257), torch.bfloat16, seed=13)
    x[:64, :64] = 0
    for ue8m0 in (False, True):
        assert_same(vllm_cast, x, BlockFp8Format(block=(64, 64), ue8m0=ue8m0), compiled=True)
