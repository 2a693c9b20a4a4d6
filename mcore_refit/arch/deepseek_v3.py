"""DeepSeek-V3: MLA projections and norms, first dense layers, shared experts, sigmoid router
with an fp32 score-correction bias. MTP layers are skipped by the source.

Megatron's MLA keeps HF's layouts: q_up rows per head [nope, rope], kv_down rows
[kv_lora_rank, rope], kv_up rows per head [k_nope, v]; its RoPE applies the same interleave
permutation as HF's `rope_interleave=True`, so every projection is a plain copy.
"""

from __future__ import annotations

from mcore_refit.arch.llama import LLAMA
from mcore_refit.arch.moe import moe_rules
from mcore_refit.convert import Rule

_A = "decoder.layers.{L}.self_attention."
_HA = "model.layers.{L}.self_attn."

MLA_RULES = [
    Rule(_A + "linear_q_proj.weight", (_HA + "q_proj.weight",)),  # q_lora_rank=None
    Rule(_A + "linear_q_down_proj.weight", (_HA + "q_a_proj.weight",)),
    Rule(_A + "q_layernorm.weight", (_HA + "q_a_layernorm.weight",)),
    Rule(_A + "linear_q_up_proj.layer_norm_weight", (_HA + "q_a_layernorm.weight",)),  # TE
    Rule(_A + "linear_q_up_proj.weight", (_HA + "q_b_proj.weight",)),
    Rule(_A + "linear_kv_down_proj.weight", (_HA + "kv_a_proj_with_mqa.weight",)),
    Rule(_A + "kv_layernorm.weight", (_HA + "kv_a_layernorm.weight",)),
    Rule(_A + "linear_kv_up_proj.layer_norm_weight", (_HA + "kv_a_layernorm.weight",)),  # TE
    Rule(_A + "linear_kv_up_proj.weight", (_HA + "kv_b_proj.weight",)),
]

DEEPSEEK_V3 = LLAMA.extend("deepseek_v3",
                           MLA_RULES + moe_rules("shared_experts", shared_gate=False))
