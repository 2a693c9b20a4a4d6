"""Tiny Megatron GPT models and matching transformers configs, one per architecture."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

VOCAB = 100  # true vocabulary; Megatron holds PADDED_VOCAB rows (padding must be stripped)
PADDED_VOCAB = 128
SEQ = 12
HIDDEN = 64
LAYERS = 4


@dataclass(frozen=True)
class Layout:
    arch: str = "qwen3"
    tp: int = 1
    pp: int = 1
    vpp: int | None = None
    ep: int = 1
    etp: int | None = None
    tied: bool = False
    groups: int = 2
    wrap: bool = False  # hand the source DDP(wrapper(model)) chunks: `module.module.` names

    @property
    def label(self) -> str:
        parts = [self.arch, f"tp{self.tp}"]
        parts += [f"pp{self.pp}"] if self.pp > 1 else []
        parts += [f"vpp{self.vpp}"] if self.vpp else []
        parts += [f"ep{self.ep}"] if self.ep > 1 else []
        parts += [f"etp{self.etp}"] if self.etp else []
        parts += ["tied"] if self.tied else []
        parts += [f"g{self.groups}"] if self.groups != 2 else []
        parts += ["wrapped"] if self.wrap else []
        return "-".join(parts)


@dataclass(frozen=True)
class Arch:
    model_type: str
    qk_norm: bool = False
    qkv_bias: bool = False
    moe: bool = False
    mla: bool = False
    extra: dict[str, Any] = field(default_factory=dict)


ARCHS = {
    "llama": Arch("llama"),
    "qwen2": Arch("qwen2", qkv_bias=True),
    "qwen3": Arch("qwen3", qk_norm=True),
    "qwen3_moe": Arch("qwen3_moe", qk_norm=True, moe=True),
    "deepseek_v3": Arch("deepseek_v3", qk_norm=True, moe=True, mla=True),
}
Q_LORA, KV_LORA, NOPE, ROPE, V_DIM, SCALING = 48, 32, 16, 8, 16, 2.5
HEADS, HEAD_DIM, FFN, EXPERTS, TOPK, MOE_FFN = 8, 16, 128, 4, 2, 32


def megatron_config(layout: Layout) -> Any:
    from megatron.core.transformer.transformer_config import TransformerConfig

    arch = ARCHS[layout.arch]
    kw: dict[str, Any] = dict(
        num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS,
        num_query_groups=layout.groups, kv_channels=HEAD_DIM, ffn_hidden_size=FFN,
        use_cpu_initialization=True, normalization="RMSNorm", layernorm_epsilon=1e-6,
        gated_linear_unit=True, add_bias_linear=False, add_qkv_bias=arch.qkv_bias,
        activation_func=torch.nn.functional.silu, params_dtype=torch.float32,
        qk_layernorm=arch.qk_norm, tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        virtual_pipeline_model_parallel_size=layout.vpp, pipeline_dtype=torch.float32,
        hidden_dropout=0.0, attention_dropout=0.0,
    )
    if arch.moe:
        kw.update(num_moe_experts=EXPERTS, moe_router_topk=TOPK, moe_ffn_hidden_size=MOE_FFN,
                  moe_token_dispatcher_type="allgather", moe_router_load_balancing_type="none",
                  expert_model_parallel_size=layout.ep,
                  expert_tensor_parallel_size=layout.etp or layout.tp)
    if not arch.mla:
        return TransformerConfig(**kw)
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    kw.pop("kv_channels")
    kw.update(q_lora_rank=Q_LORA, kv_lora_rank=KV_LORA, qk_head_dim=NOPE,
              qk_pos_emb_head_dim=ROPE, v_head_dim=V_DIM, rope_type="rope", rotary_base=10000,
              moe_layer_freq=[0] + [1] * (LAYERS - 1), moe_shared_expert_intermediate_size=MOE_FFN,
              moe_router_enable_expert_bias=True, moe_router_score_function="sigmoid",
              moe_router_topk_scaling_factor=SCALING)
    return MLATransformerConfig(**kw)


def hf_config(layout: Layout) -> Any:
    import transformers

    arch = ARCHS[layout.arch]
    kw: dict[str, Any] = dict(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, num_key_value_heads=layout.groups, head_dim=HEAD_DIM,
        max_position_embeddings=64, rms_norm_eps=1e-6, tie_word_embeddings=layout.tied,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )
    if arch.model_type == "llama":
        kw.update(attention_bias=False, mlp_bias=False)
    if arch.mla:
        kw.pop("head_dim")
        kw.update(n_routed_experts=EXPERTS, num_experts_per_tok=TOPK, n_shared_experts=1,
                  moe_intermediate_size=MOE_FFN, first_k_dense_replace=1, n_group=1,
                  topk_group=1, routed_scaling_factor=SCALING, norm_topk_prob=True,
                  q_lora_rank=Q_LORA, kv_lora_rank=KV_LORA, qk_nope_head_dim=NOPE,
                  qk_rope_head_dim=ROPE, v_head_dim=V_DIM, rope_interleave=True,
                  num_key_value_heads=HEADS)
    elif arch.moe:
        kw.update(num_experts=EXPERTS, num_experts_per_tok=TOPK, moe_intermediate_size=MOE_FFN,
                  norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[])
    cls = transformers.AutoConfig.for_model(arch.model_type, **kw)
    cls._attn_implementation = "eager"
    return cls


def build_chunks(layout: Layout) -> list[torch.nn.Module]:
    """The model chunks of this rank (one per virtual pipeline stage)."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel

    config = megatron_config(layout)
    arch = ARCHS[layout.arch]
    chunks = []
    for v in range(layout.vpp or 1):
        vp = v if layout.vpp else None
        if arch.mla:
            from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

            from tests.mcore.mla_attention import MLACoreAttention, patch_megatron_mla

            patch_megatron_mla()
            spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False,
                                              normalization="RMSNorm", vp_stage=vp)
            for layer_spec in spec.layer_specs:
                layer_spec.submodules.self_attention.submodules.core_attention = \
                    MLACoreAttention
        else:
            spec = get_gpt_layer_local_spec(num_experts=EXPERTS if arch.moe else None,
                                            qk_layernorm=arch.qk_norm, normalization="RMSNorm")
        chunks.append(GPTModel(
            config, spec, vocab_size=PADDED_VOCAB, max_sequence_length=64,
            pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp),
            post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp),
            parallel_output=False, share_embeddings_and_output_weights=layout.tied,
            position_embedding_type="rope", rotary_base=10000, vp_stage=vp))
    return chunks


class Wrapper(torch.nn.Module):
    """Stands in for Float16Module (which would cast to bf16/fp16): adds a `module.` level."""

    def __init__(self, module: torch.nn.Module) -> None:
        super().__init__()
        self.module = module


def wrap_chunks(layout: Layout, chunks: list[torch.nn.Module]) -> list[torch.nn.Module]:
    """Megatron DDP around a `module.` wrapper, as training jobs hand their chunks over."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    config = megatron_config(layout)
    return [DistributedDataParallel(config, DistributedDataParallelConfig(), Wrapper(c))
            for c in chunks]
