"""Qwen3-MoE: Qwen3 attention, MoE MLP in checkpoint names (`mlp.experts.{E}.*`, `mlp.gate`).

Expert tensors arrive with canonical names `mlp.experts.{E}.linear_fc1/2.weight` where E is
the global expert id (the source maps local slots / TE grouped names to it).
"""

from __future__ import annotations

from mcore_refit.arch.qwen3 import QWEN3
from mcore_refit.convert import Rule

_M = "decoder.layers.{L}.mlp."
_H = "model.layers.{L}.mlp."

MOE_RULES = [
    Rule(_M + "router.weight", (_H + "gate.weight",)),
    Rule(_M + "router.expert_bias", (_H + "gate.e_score_correction_bias",), fp32=True),
    Rule(_M + "experts.{E}.linear_fc1.weight",
         (_H + "experts.{E}.gate_proj.weight", _H + "experts.{E}.up_proj.weight"), "gate_up"),
    Rule(_M + "experts.{E}.linear_fc2.weight", (_H + "experts.{E}.down_proj.weight",)),
    Rule(_M + "shared_experts.linear_fc1.weight",
         (_H + "shared_expert.gate_proj.weight", _H + "shared_expert.up_proj.weight"), "gate_up"),
    Rule(_M + "shared_experts.linear_fc2.weight", (_H + "shared_expert.down_proj.weight",)),
    Rule(_M + "shared_experts.gate_weight", (_H + "shared_expert_gate.weight",)),
]

QWEN3_MOE = QWEN3.extend("qwen3_moe", MOE_RULES)
