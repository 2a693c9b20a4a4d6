"""Qwen3: Llama layout plus per-head q/k RMSNorms (Megatron `q_layernorm` / `k_layernorm`)."""

from __future__ import annotations

from mcore_refit.arch.llama import LLAMA
from mcore_refit.convert import Rule

_A = "decoder.layers.{L}.self_attention."
_H = "model.layers.{L}.self_attn."

QK_NORM_RULES = [
    Rule(_A + "q_layernorm.weight", (_H + "q_norm.weight",)),
    Rule(_A + "k_layernorm.weight", (_H + "k_norm.weight",)),
]

QWEN3 = LLAMA.extend("qwen3", QK_NORM_RULES)
