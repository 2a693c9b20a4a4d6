"""Qwen2: Llama layout plus a q/k/v bias (covered by the shared `linear_qkv.bias` rule)."""

from __future__ import annotations

from mcore_refit.arch.llama import LLAMA

QWEN2 = LLAMA.extend("qwen2", [])
