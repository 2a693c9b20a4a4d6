"""Core attention for Multi-Latent Attention with the local (non-TE) spec (CPU, no TE).

megatron-core 0.16.1's local MLA spec is broken: MLASelfAttention passes `k_channels` /
`v_channels` to the local DotProductAttention, which does not accept them (TypeError at
build). This plain causal attention accepts them and handles q/k and v head dims that differ.
"""

from __future__ import annotations

from typing import Any

import torch
from megatron.core.transformer.module import MegatronModule


class MLACoreAttention(MegatronModule):
    def __init__(self, config: Any, layer_number: int, attn_mask_type: Any,
                 attention_type: str, softmax_scale: float | None = None,
                 k_channels: int | None = None, v_channels: int | None = None,
                 **_: Any) -> None:
        super().__init__(config=config)
        self.softmax_scale = softmax_scale or (k_channels or config.kv_channels) ** -0.5

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: torch.Tensor | None, **_: Any) -> torch.Tensor:
        # [s, b, heads, dim] -> [b, heads, s, dim]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        scores = torch.matmul(q, k.transpose(-1, -2)) * self.softmax_scale
        if attention_mask is not None:
            scores = scores.masked_fill(attention_mask, float("-inf"))
        out = torch.matmul(scores.softmax(-1), v)  # [b, heads, s, dv]
        b, h, s, d = out.shape
        return out.permute(2, 0, 1, 3).reshape(s, b, h * d)


def patch_megatron_mla() -> None:
    """0.16.1 imports `megatron.core.extensions.transformer_engine` without TE installed, so
    MLA sees HAVE_TE=True with TELinear a MagicMock placeholder; `isinstance` fails at build."""
    from megatron.core.transformer import multi_latent_attention as mla

    if not isinstance(mla.TELinear, type):
        mla.HAVE_TE = False
