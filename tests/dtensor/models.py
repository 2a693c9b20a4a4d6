"""Tiny transformers models from configs (random init, nothing downloaded) for the DTensor tests.

Sizes are the smallest that keep each architecture's real layout: head_dim >= 32 (vLLM CPU
attention), DeepSeek-V3 MLA with kv_lora_rank + qk_rope_head_dim = 576, one dense and one MoE
layer, sigmoid / noaux_tc routing so the fp32 `e_score_correction_bias` exists.
"""

from __future__ import annotations

import zlib

import torch

VOCAB = 128
HIDDEN = 64


def make_config(arch: str, tie: bool = False):
    """A tiny config of `arch` ("qwen3", "qwen3_moe", "deepseek_v3")."""
    from transformers import DeepseekV3Config, Qwen3Config, Qwen3MoeConfig

    common = dict(vocab_size=VOCAB, hidden_size=HIDDEN, num_attention_heads=2,
                  num_key_value_heads=2, max_position_embeddings=64,
                  tie_word_embeddings=tie)
    if arch == "qwen3":
        return Qwen3Config(**common, intermediate_size=96, num_hidden_layers=2, head_dim=32)
    if arch == "qwen3_moe":
        return Qwen3MoeConfig(**common, intermediate_size=96, moe_intermediate_size=32,
                              num_hidden_layers=2, head_dim=32, num_experts=4,
                              num_experts_per_tok=2, decoder_sparse_step=1,
                              mlp_only_layers=[0])
    if arch == "deepseek_v3":
        return DeepseekV3Config(**common, intermediate_size=96, moe_intermediate_size=32,
                                num_hidden_layers=2, first_k_dense_replace=1,
                                n_routed_experts=4, num_experts_per_tok=2, n_group=2,
                                topk_group=1, n_shared_experts=1, q_lora_rank=32,
                                kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=32,
                                v_head_dim=32, topk_method="noaux_tc", scoring_func="sigmoid",
                                rope_scaling=None)
    raise ValueError(f"unknown arch {arch!r}")


def make_model(arch: str, tie: bool = False, dtype: torch.dtype = torch.float32):
    """The model in `dtype`; the router bias stays fp32 only if transformers keeps it so."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(make_config(arch, tie))
    return model.to(dtype) if dtype != torch.float32 else model


def random_value(name: str, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """A fresh fp32 value for `name`, the same on every rank (seeded by name)."""
    g = torch.Generator().manual_seed(zlib.crc32(f"{seed}:{name}".encode()))
    noise = torch.randn(shape, generator=g, dtype=torch.float32)
    if name.endswith("e_score_correction_bias"):
        # 1 + 2^-12 .. : values bf16 cannot hold, so a bf16 round trip is visible.
        return 1.0 + noise * 1e-3
    if len(shape) == 1:
        return 1.0 + 0.2 * noise
    return noise * 0.1
