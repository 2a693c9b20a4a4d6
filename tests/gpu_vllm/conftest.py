"""Every test here needs a CUDA build of vLLM on a GPU (`pytest -m gpu_vllm` on the GPU
machine); elsewhere they skip, so `make test` on CPU never runs them. The serve tests' tiny
Qwen3 checkpoints (`checkpoints`) are shared with tests/serve."""

from __future__ import annotations

import pytest
import torch

from tests.serve.conftest import checkpoints  # noqa: F401 - the fixture, shared


def cuda_vllm_missing() -> str | None:
    """Why no CUDA vLLM engine can run here, or None."""
    if not torch.cuda.is_available():
        return "no CUDA device"
    try:
        import vllm  # noqa: F401
        from vllm.platforms import current_platform
    except ImportError as e:
        return f"vLLM is not importable: {e}"
    return None if current_platform.is_cuda() else "vLLM is not a CUDA build"


@pytest.fixture(scope="session", autouse=True)
def _needs_cuda_vllm() -> None:
    if why := cuda_vllm_missing():
        pytest.skip(why)
