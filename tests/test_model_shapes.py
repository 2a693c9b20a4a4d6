"""The benchmarks' checkpoint-shaped tensor lists agree with transformers' own models: for a
small config of each architecture, the same names and shapes as the checkpoint tensors of the
model transformers builds (listed by `DTensorWeightSource`, as a refit sends them); and the
published configs give the published parameter counts."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

from model_shapes import (  # noqa: E402
    PUBLISHED,
    DeepseekV3Config,
    Qwen3Config,
    deepseek_v3_shapes,
    qwen3_shapes,
)


def _checkpoint(config) -> set[tuple[str, tuple[int, ...]]]:
    from transformers import AutoModelForCausalLM

    from dtensor_refit import DTensorWeightSource, DtypePolicy

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    specs = DTensorWeightSource(model, DtypePolicy(torch.bfloat16)).plan_specs()
    return {(s.name, tuple(s.shape)) for s in specs}


def _tiny(arch: str):
    from transformers import Qwen3Config as HfQwen3
    from transformers import Qwen3MoeConfig

    from tests.dtensor.models import make_config

    if arch == "deepseek_v3":
        hf = make_config("deepseek_v3")
        return hf, deepseek_v3_shapes(DeepseekV3Config(
            layers=hf.num_hidden_layers, hidden=hf.hidden_size, heads=hf.num_attention_heads,
            q_lora_rank=hf.q_lora_rank, kv_lora_rank=hf.kv_lora_rank,
            qk_nope=hf.qk_nope_head_dim, qk_rope=hf.qk_rope_head_dim, v_head=hf.v_head_dim,
            routed_experts=hf.n_routed_experts, shared_experts=hf.n_shared_experts,
            moe_intermediate=hf.moe_intermediate_size, intermediate=hf.intermediate_size,
            first_dense=hf.first_k_dense_replace, vocab=hf.vocab_size))
    mine = Qwen3Config(layers=2, hidden=64, heads=4, kv_heads=2, head_dim=32, vocab=128,
                       intermediate=96 if arch == "qwen3" else 0,
                       experts=4 if arch == "qwen3_moe" else 0, moe_intermediate=32)
    common = dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=32, tie_word_embeddings=False)
    if arch == "qwen3":
        return HfQwen3(**common, intermediate_size=96), qwen3_shapes(mine)
    return Qwen3MoeConfig(**common, moe_intermediate_size=32, num_experts=4,
                          num_experts_per_tok=2, decoder_sparse_step=1,
                          mlp_only_layers=[]), qwen3_shapes(mine)


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe", "deepseek_v3"])
def test_the_shape_lists_match_transformers_checkpoints(arch: str) -> None:
    hf, shapes = _tiny(arch)
    assert len(shapes) == len(set(shapes))
    assert set(shapes) == _checkpoint(hf)


def test_the_published_configs_give_the_published_sizes() -> None:
    params = {name: sum(math.prod(s) for _, s in make()) / 1e9 for name, make in PUBLISHED.items()}
    assert params["Qwen3-30B-A3B"] == pytest.approx(30.5, rel=0.01)
    assert params["Qwen3-235B-A22B"] == pytest.approx(235, rel=0.01)
    assert params["DeepSeek-V3"] == pytest.approx(671, rel=0.01)  # its MTP layer aside
    assert 1000 < params["Kimi-K2"] < 1050  # "1T total parameters"
