"""Single-process checks of the conversion tables and name canonicalisation (no Megatron)."""

from __future__ import annotations

import pytest
import torch

from common.errors import ConversionError
from mcore_refit import converter_for, names
from mcore_refit.convert import Dims, cut_shapes, cut_tensor

DIMS = Dims(num_heads=8, num_query_groups=2, head_dim=4, vocab_size=10)


def test_transformer_engine_fused_norm_names() -> None:
    conv = converter_for("qwen3")
    qkv_norm = conv.targets("decoder.layers.3.self_attention.linear_qkv.layer_norm_weight",
                            (16,), DIMS)
    fc1_norm = conv.targets("decoder.layers.3.mlp.linear_fc1.layer_norm_weight", (16,), DIMS)
    assert [t.name for t in qkv_norm] == ["model.layers.3.input_layernorm.weight"]
    assert [t.name for t in fc1_norm] == ["model.layers.3.post_attention_layernorm.weight"]
    dsv3 = converter_for("deepseek_v3")
    q_norm = dsv3.targets("decoder.layers.0.self_attention.linear_q_up_proj.layer_norm_weight",
                          (12,), DIMS)
    assert [t.name for t in q_norm] == ["model.layers.0.self_attn.q_a_layernorm.weight"]


def test_expert_slots_local_and_te_grouped() -> None:
    assert names.expert_slot("decoder.layers.1.mlp.experts.local_experts.3.linear_fc2.weight") \
        == ("decoder.layers.1.mlp.experts.{E}.linear_fc2.weight", 3)
    assert names.expert_slot("decoder.layers.1.mlp.experts.linear_fc1.weight7") \
        == ("decoder.layers.1.mlp.experts.{E}.linear_fc1.weight", 7)
    assert names.expert_slot("decoder.layers.1.mlp.shared_experts.linear_fc1.weight") is None


def test_skips_and_wrappers() -> None:
    assert names.skipped("decoder.layers.0.self_attention.linear_qkv._extra_state")
    assert names.skipped("mtp.layers.0.enorm.weight")
    assert not names.skipped("decoder.layers.0.mlp.linear_fc1.weight")
    assert names.strip_module_prefixes("module.module.output_layer.weight") == "output_layer.weight"
    assert names.globalize_layer("decoder.layers.1.mlp.linear_fc2.weight", {1: 6}) == (
        "decoder.layers.6.mlp.linear_fc2.weight", 6)


def test_unknown_parameter_is_an_error() -> None:
    with pytest.raises(ConversionError, match="no conversion rule"):
        converter_for("llama").targets("decoder.layers.0.self_attention.mystery.weight", (4,),
                                       DIMS)


@pytest.mark.parametrize("cut,shape", [("qkv", (48, 16)), ("qkv", (48,)),
                                       ("gate_up", (20, 16)), ("trim_vocab", (16, 8)),
                                       ("whole", (3, 5))])
def test_cut_shapes_agree_with_cut_tensors(cut: str, shape: tuple[int, ...]) -> None:
    full = torch.randn(shape)
    assert [tuple(t.shape) for t in cut_tensor(cut, full, DIMS)] == cut_shapes(cut, shape, DIMS)


def test_qkv_deinterleaves_per_group() -> None:
    # rows: group 0 = [q0..q3, k0, v0], group 1 = [q4..q7, k1, v1]; one row per head.
    d = Dims(num_heads=8, num_query_groups=2, head_dim=1, vocab_size=1)
    full = torch.arange(12.0)
    q, k, v = cut_tensor("qkv", full, d)
    assert q.tolist() == [0, 1, 2, 3, 6, 7, 8, 9]
    assert k.tolist() == [4, 10] and v.tolist() == [5, 11]
