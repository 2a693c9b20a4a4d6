"""The tiny Megatron GPT models of the recipes, tests and CPU benchmarks, and the matching
transformers configs: one `Layout` (architecture and parallelism), two size sets.

`SERVABLE` sizes are what vLLM's CPU kernels serve (head_dim >= 32); `TINY` ones are smaller,
for checks against transformers only. Megatron holds a padded vocabulary (`padded_vocab`
rows); the refit sends the true `vocab` rows only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class Sizes:
    vocab: int
    padded_vocab: int
    hidden: int
    heads: int
    head_dim: int
    ffn: int
    layers: int
    experts: int
    topk: int
    moe_ffn: int
    max_pos: int


SERVABLE = Sizes(vocab=192, padded_vocab=256, hidden=128, heads=4, head_dim=32, ffn=256,
                 layers=4, experts=4, topk=2, moe_ffn=64, max_pos=128)
TINY = Sizes(vocab=100, padded_vocab=128, hidden=64, heads=8, head_dim=16, ffn=128, layers=4,
             experts=4, topk=2, moe_ffn=32, max_pos=64)


@dataclass(frozen=True)
class Arch:
    model_type: str
    qk_norm: bool = False
    qkv_bias: bool = False
    moe: bool = False
    mla: bool = False


ARCHS = {
    "llama": Arch("llama"),
    "qwen2": Arch("qwen2", qkv_bias=True),
    "qwen3": Arch("qwen3", qk_norm=True),
    "qwen3_moe": Arch("qwen3_moe", qk_norm=True, moe=True),
    "deepseek_v3": Arch("deepseek_v3", qk_norm=True, moe=True, mla=True),
}
# DeepSeek-V3's MLA and router dims (TINY-sized)
Q_LORA, KV_LORA, NOPE, ROPE, V_DIM, SCALING = 48, 32, 16, 8, 16, 2.5


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
    wrap: bool = False  # tests: hand the source DDP(wrapper(model)) chunks (`module.module.`)
    sizes: Sizes = SERVABLE

    @property
    def model_type(self) -> str:
        return ARCHS[self.arch].model_type

    @property
    def moe(self) -> bool:
        return ARCHS[self.arch].moe

    @property
    def label(self) -> str:
        parts = [f"TP{self.tp}", f"PP{self.pp}"] + [f"VPP{self.vpp}"] * bool(self.vpp)
        parts += [f"EP{self.ep}"] * self.moe + [f"ETP{self.etp}"] * bool(self.etp)
        extras = ["tied"] * self.tied + [f"g{self.groups}"] * (self.groups != 2)
        return " ".join([self.arch, "x".join(parts), *extras, *["wrapped"] * self.wrap])


def setup_parallel(layout: Layout, seed: int = 1234) -> None:
    """Megatron's parallel state for `layout` (torch.distributed already initialised)."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    ps.destroy_model_parallel()
    ps.initialize_model_parallel(
        tensor_model_parallel_size=layout.tp, pipeline_model_parallel_size=layout.pp,
        virtual_pipeline_model_parallel_size=layout.vpp,
        expert_model_parallel_size=layout.ep, expert_tensor_parallel_size=layout.etp)
    model_parallel_cuda_manual_seed(seed, force_reset_rng=True)


def megatron_config(layout: Layout) -> Any:
    from megatron.core.transformer.transformer_config import TransformerConfig

    arch, z = ARCHS[layout.arch], layout.sizes
    kw: dict[str, Any] = dict(
        num_layers=z.layers, hidden_size=z.hidden, num_attention_heads=z.heads,
        num_query_groups=layout.groups, kv_channels=z.head_dim, ffn_hidden_size=z.ffn,
        use_cpu_initialization=True, normalization="RMSNorm", layernorm_epsilon=1e-6,
        gated_linear_unit=True, add_bias_linear=False, add_qkv_bias=arch.qkv_bias,
        activation_func=torch.nn.functional.silu, params_dtype=torch.float32,
        qk_layernorm=arch.qk_norm, tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        virtual_pipeline_model_parallel_size=layout.vpp, pipeline_dtype=torch.float32,
        hidden_dropout=0.0, attention_dropout=0.0,
    )
    if arch.moe:
        kw.update(num_moe_experts=z.experts, moe_router_topk=z.topk, moe_ffn_hidden_size=z.moe_ffn,
                  moe_token_dispatcher_type="allgather", moe_router_load_balancing_type="none",
                  expert_model_parallel_size=layout.ep,
                  expert_tensor_parallel_size=layout.etp or layout.tp)
    if not arch.mla:
        return TransformerConfig(**kw)
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    kw.pop("kv_channels")
    kw.update(q_lora_rank=Q_LORA, kv_lora_rank=KV_LORA, qk_head_dim=NOPE,
              qk_pos_emb_head_dim=ROPE, v_head_dim=V_DIM, rope_type="rope", rotary_base=10000,
              moe_layer_freq=[0] + [1] * (z.layers - 1),
              moe_shared_expert_intermediate_size=z.moe_ffn,
              moe_router_enable_expert_bias=True, moe_router_score_function="sigmoid",
              moe_router_topk_scaling_factor=SCALING)
    return MLATransformerConfig(**kw)


def hf_config(layout: Layout) -> Any:
    """The transformers config of the same model (eager attention for exact comparisons)."""
    import transformers

    arch, z = ARCHS[layout.arch], layout.sizes
    kw: dict[str, Any] = dict(
        vocab_size=z.vocab, hidden_size=z.hidden, intermediate_size=z.ffn,
        num_hidden_layers=z.layers, num_attention_heads=z.heads,
        num_key_value_heads=layout.groups, head_dim=z.head_dim, max_position_embeddings=z.max_pos,
        rms_norm_eps=1e-6, tie_word_embeddings=layout.tied,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )
    if arch.model_type == "llama":
        kw.update(attention_bias=False, mlp_bias=False)
    if arch.mla:
        kw.pop("head_dim")
        kw.update(n_routed_experts=z.experts, num_experts_per_tok=z.topk, n_shared_experts=1,
                  moe_intermediate_size=z.moe_ffn, first_k_dense_replace=1, n_group=1,
                  topk_group=1, routed_scaling_factor=SCALING, norm_topk_prob=True,
                  q_lora_rank=Q_LORA, kv_lora_rank=KV_LORA, qk_nope_head_dim=NOPE,
                  qk_rope_head_dim=ROPE, v_head_dim=V_DIM, rope_interleave=True,
                  num_key_value_heads=z.heads)
    elif arch.moe:
        kw.update(num_experts=z.experts, num_experts_per_tok=z.topk,
                  moe_intermediate_size=z.moe_ffn, norm_topk_prob=True, decoder_sparse_step=1,
                  mlp_only_layers=[])
    config = transformers.AutoConfig.for_model(arch.model_type, **kw)
    config._attn_implementation = "eager"
    return config


def _layer_spec(layout: Layout, config: Any, vp_stage: int | None) -> Any:
    arch = ARCHS[layout.arch]
    if not arch.mla:
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

        return get_gpt_layer_local_spec(num_experts=layout.sizes.experts if arch.moe else None,
                                        qk_layernorm=arch.qk_norm, normalization="RMSNorm")
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    from recipes.mcore_mla_attention import MLACoreAttention, patch_megatron_mla

    patch_megatron_mla()
    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False,
                                      normalization="RMSNorm", vp_stage=vp_stage)
    for layer_spec in spec.layer_specs:
        layer_spec.submodules.self_attention.submodules.core_attention = MLACoreAttention
    return spec


def build_chunks(layout: Layout, parallel_output: bool = False) -> list[torch.nn.Module]:
    """This rank's model chunks (one per virtual pipeline stage), fp32 on CPU.
    `parallel_output`: the last stage's logits stay split over TP (vocab-parallel)."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt.gpt_model import GPTModel

    config = megatron_config(layout)
    chunks = []
    for v in range(layout.vpp or 1):
        vp = v if layout.vpp else None
        chunks.append(GPTModel(
            config, _layer_spec(layout, config, vp), vocab_size=layout.sizes.padded_vocab,
            max_sequence_length=layout.sizes.max_pos,
            pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp),
            post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp),
            parallel_output=parallel_output, share_embeddings_and_output_weights=layout.tied,
            position_embedding_type="rope", rotary_base=10000, vp_stage=vp))
    return chunks
