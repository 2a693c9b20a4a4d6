"""CPU stand-ins for the torch.cuda calls megatron-core makes unconditionally.

megatron-core 0.16.1 calls torch.cuda.current_device / synchronize / RNG state and
Tensor.cuda() in MoE router, RNG seeding, forward and the PP schedule even on CPU. These
no-ops let the real code run on gloo/CPU. The CPU recipes and tests install them; the
library never does (it patches torch.cuda for the whole process).
"""

from __future__ import annotations

import torch

_INSTALLED = False


def install() -> None:
    global _INSTALLED
    if _INSTALLED:
        return
    _INSTALLED = True
    cuda = torch.cuda
    cuda.current_device = lambda: "cpu"  # type: ignore[assignment]
    cuda.synchronize = lambda *a, **k: None  # type: ignore[assignment]
    cuda.get_rng_state = lambda *a, **k: torch.get_rng_state()  # type: ignore[assignment]
    cuda.set_rng_state = lambda *a, **k: None  # type: ignore[assignment]
    cuda.manual_seed = lambda *a, **k: None  # type: ignore[assignment]
    cuda.manual_seed_all = lambda *a, **k: None  # type: ignore[assignment]
    cuda.device_count = lambda: 0  # type: ignore[assignment]
    cuda.random.get_rng_state = cuda.get_rng_state  # type: ignore[assignment]
    cuda.random.set_rng_state = cuda.set_rng_state  # type: ignore[assignment]
    torch.Tensor.cuda = lambda self, *a, **k: self  # type: ignore[assignment]
    from megatron.core.tensor_parallel import random as mrandom

    mrandom._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
    mrandom._set_cuda_rng_state = lambda *a, **k: None
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):  # 0.16.1 names it only when TE imports
        moe_utils.te_general_gemm = None
