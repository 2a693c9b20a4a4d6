"""Llama (and the shared dense GPT core other tables extend): Megatron local and TE names."""

from __future__ import annotations

from mcore_refit.convert import Converter, Rule

_A = "decoder.layers.{L}.self_attention."
_M = "decoder.layers.{L}.mlp."
_H = "model.layers.{L}."

RULES = [
    Rule("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), "trim_vocab"),
    Rule("decoder.layers.{L}.input_layernorm.weight", (_H + "input_layernorm.weight",)),
    # Transformer-Engine specs fuse the norms into the following linear.
    Rule(_A + "linear_qkv.layer_norm_weight", (_H + "input_layernorm.weight",)),
    Rule(_A + "linear_qkv.weight", tuple(_H + f"self_attn.{p}_proj.weight" for p in "qkv"), "qkv"),
    Rule(_A + "linear_qkv.bias", tuple(_H + f"self_attn.{p}_proj.bias" for p in "qkv"), "qkv"),
    Rule(_A + "linear_proj.weight", (_H + "self_attn.o_proj.weight",)),
    Rule("decoder.layers.{L}.pre_mlp_layernorm.weight", (_H + "post_attention_layernorm.weight",)),
    Rule(_M + "linear_fc1.layer_norm_weight", (_H + "post_attention_layernorm.weight",)),
    Rule(_M + "linear_fc1.weight", (_H + "mlp.gate_proj.weight", _H + "mlp.up_proj.weight"),
         "gate_up"),
    Rule(_M + "linear_fc2.weight", (_H + "mlp.down_proj.weight",)),
    Rule("decoder.final_layernorm.weight", ("model.norm.weight",)),
    Rule("output_layer.weight", ("lm_head.weight",), "trim_vocab"),
]

LLAMA = Converter("llama", RULES)
