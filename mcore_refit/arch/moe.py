"""The MoE MLP rules Qwen3-MoE and DeepSeek-V3 share: router, its fp32 expert bias, routed
experts (canonical names `mlp.experts.{E}.*`, E the global expert id), shared experts."""

from __future__ import annotations

from mcore_refit.convert import Rule

_M = "decoder.layers.{L}.mlp."
_H = "model.layers.{L}.mlp."


def moe_rules(shared: str, shared_gate: bool) -> list[Rule]:
    """`shared`: the HF module of the shared experts (`shared_expert` in Qwen3-MoE,
    `shared_experts` in DeepSeek-V3); `shared_gate`: it has a sigmoid gate of its own."""
    rules = [
        Rule(_M + "router.weight", (_H + "gate.weight",)),
        Rule(_M + "router.expert_bias", (_H + "gate.e_score_correction_bias",)),
        Rule(_M + "experts.{E}.linear_fc1.weight",
             (_H + "experts.{E}.gate_proj.weight", _H + "experts.{E}.up_proj.weight"),
             "gate_up"),
        Rule(_M + "experts.{E}.linear_fc2.weight", (_H + "experts.{E}.down_proj.weight",)),
        Rule(_M + "shared_experts.linear_fc1.weight",
             (_H + f"{shared}.gate_proj.weight", _H + f"{shared}.up_proj.weight"), "gate_up"),
        Rule(_M + "shared_experts.linear_fc2.weight", (_H + f"{shared}.down_proj.weight",)),
    ]
    if shared_gate:
        rules.append(Rule(_M + "shared_experts.gate_weight", (_H + "shared_expert_gate.weight",)))
    return rules
