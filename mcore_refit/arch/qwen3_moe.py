"""Qwen3-MoE: Qwen3 attention, MoE MLP in checkpoint names (`mlp.experts.{E}.*`, `mlp.gate`).

Expert tensors arrive with canonical names `mlp.experts.{E}.linear_fc1/2.weight` where E is
the global expert id (the source maps local slots / TE grouped names to it).
"""

from __future__ import annotations

from mcore_refit.arch.moe import moe_rules
from mcore_refit.arch.qwen3 import QWEN3

QWEN3_MOE = QWEN3.extend("qwen3_moe", moe_rules("shared_expert", shared_gate=True))
