"""Tensor lists shaped like real checkpoints (HF names and shapes), for the benchmarks.

The refit's cost depends on the tensor count and size mix as much as on the bytes: an MoE
checkpoint is ~19k mostly small tensors, a dense one a few hundred large ones. `scale` shrinks
every tensor's first dimension (at least 1 row) so a list fits a smaller machine while keeping
its count and order. The numbers come from the models' published configs (names and shapes
only; nothing is downloaded), each cited where it is defined; `tests/test_model_shapes.py`
checks the functions against transformers' own models built from small configs.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

Shapes = list[tuple[str, tuple[int, ...]]]


@dataclass(frozen=True)
class Qwen3Config:
    """The few config numbers that fix a Qwen3 (dense or MoE) checkpoint's tensor shapes."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    intermediate: int = 0  # dense MLP
    experts: int = 0
    moe_intermediate: int = 0


# huggingface.co/Qwen/Qwen3-30B-A3B, Qwen/Qwen3-8B, Qwen/Qwen3-235B-A22B: config.json
QWEN3_30B_A3B = Qwen3Config(layers=48, hidden=2048, heads=32, kv_heads=4, head_dim=128,
                            vocab=151_936, experts=128, moe_intermediate=768)
QWEN3_8B = Qwen3Config(layers=36, hidden=4096, heads=32, kv_heads=8, head_dim=128,
                       vocab=151_936, intermediate=12_288)
QWEN3_235B_A22B = Qwen3Config(layers=94, hidden=4096, heads=64, kv_heads=4, head_dim=128,
                              vocab=151_936, experts=128, moe_intermediate=1536)


@dataclass(frozen=True)
class DeepseekV3Config:
    """The config numbers that fix a DeepSeek-V3-architecture checkpoint's shapes (MLA
    attention, `first_dense` dense MLP layers, then routed + shared experts). Without the
    multi-token-prediction layer, which vLLM loads as a model of its own."""

    layers: int
    hidden: int
    heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope: int
    qk_rope: int
    v_head: int
    routed_experts: int
    shared_experts: int
    moe_intermediate: int
    intermediate: int
    first_dense: int
    vocab: int


# transformers' DeepseekV3Config defaults are DeepSeek-V3's (huggingface.co/deepseek-ai/
# DeepSeek-V3, config.json): 61 layers, hidden 7168, 128 heads, q / kv LoRA ranks 1536 / 512,
# qk_nope 128, qk_rope 64, v_head 128, 256 routed + 1 shared expert, moe_intermediate 2048,
# intermediate 18432, first_k_dense_replace 3, vocab 129280.
DEEPSEEK_V3 = DeepseekV3Config(layers=61, hidden=7168, heads=128, q_lora_rank=1536,
                               kv_lora_rank=512, qk_nope=128, qk_rope=64, v_head=128,
                               routed_experts=256, shared_experts=1, moe_intermediate=2048,
                               intermediate=18_432, first_dense=3, vocab=129_280)
# huggingface.co/moonshotai/Kimi-K2-Instruct, config.json: DeepSeek-V3's architecture with 384
# routed experts, 64 heads, first_k_dense_replace 1, vocab 163840.
KIMI_K2 = replace(DEEPSEEK_V3, heads=64, routed_experts=384, first_dense=1, vocab=163_840)


def _mlp(c: Qwen3Config | DeepseekV3Config, prefix: str, inner: int) -> Shapes:
    return [(f"{prefix}.gate_proj.weight", (inner, c.hidden)),
            (f"{prefix}.up_proj.weight", (inner, c.hidden)),
            (f"{prefix}.down_proj.weight", (c.hidden, inner))]


def qwen3_shapes(c: Qwen3Config) -> Shapes:
    """Every tensor of the checkpoint, in HF order (embedding, layers, final norm, head)."""
    out: Shapes = [("model.embed_tokens.weight", (c.vocab, c.hidden))]
    q, kv = c.heads * c.head_dim, c.kv_heads * c.head_dim
    for i in range(c.layers):
        p = f"model.layers.{i}"
        out += [(f"{p}.input_layernorm.weight", (c.hidden,)),
                (f"{p}.self_attn.q_proj.weight", (q, c.hidden)),
                (f"{p}.self_attn.k_proj.weight", (kv, c.hidden)),
                (f"{p}.self_attn.v_proj.weight", (kv, c.hidden)),
                (f"{p}.self_attn.o_proj.weight", (c.hidden, q)),
                (f"{p}.self_attn.q_norm.weight", (c.head_dim,)),
                (f"{p}.self_attn.k_norm.weight", (c.head_dim,)),
                (f"{p}.post_attention_layernorm.weight", (c.hidden,))]
        if c.experts:
            out.append((f"{p}.mlp.gate.weight", (c.experts, c.hidden)))
            for e in range(c.experts):
                out += _mlp(c, f"{p}.mlp.experts.{e}", c.moe_intermediate)
        else:
            out += _mlp(c, f"{p}.mlp", c.intermediate)
    return out + [("model.norm.weight", (c.hidden,)), ("lm_head.weight", (c.vocab, c.hidden))]


def _mla(c: DeepseekV3Config, p: str) -> Shapes:
    qk = c.qk_nope + c.qk_rope
    q = ([(f"{p}.q_proj.weight", (c.heads * qk, c.hidden))] if c.q_lora_rank is None else
         [(f"{p}.q_a_proj.weight", (c.q_lora_rank, c.hidden)),
          (f"{p}.q_a_layernorm.weight", (c.q_lora_rank,)),
          (f"{p}.q_b_proj.weight", (c.heads * qk, c.q_lora_rank))])
    return q + [(f"{p}.kv_a_proj_with_mqa.weight", (c.kv_lora_rank + c.qk_rope, c.hidden)),
                (f"{p}.kv_a_layernorm.weight", (c.kv_lora_rank,)),
                (f"{p}.kv_b_proj.weight", (c.heads * (c.qk_nope + c.v_head), c.kv_lora_rank)),
                (f"{p}.o_proj.weight", (c.hidden, c.heads * c.v_head))]


def deepseek_v3_shapes(c: DeepseekV3Config) -> Shapes:
    """Every tensor of the checkpoint (bf16 but the fp32 router bias `e_score_correction_bias`),
    in HF order."""
    out: Shapes = [("model.embed_tokens.weight", (c.vocab, c.hidden))]
    for i in range(c.layers):
        p = f"model.layers.{i}"
        out += [(f"{p}.input_layernorm.weight", (c.hidden,)), *_mla(c, f"{p}.self_attn"),
                (f"{p}.post_attention_layernorm.weight", (c.hidden,))]
        if i < c.first_dense:
            out += _mlp(c, f"{p}.mlp", c.intermediate)
            continue
        out += [(f"{p}.mlp.gate.weight", (c.routed_experts, c.hidden)),
                (f"{p}.mlp.gate.e_score_correction_bias", (c.routed_experts,))]
        for e in range(c.routed_experts):
            out += _mlp(c, f"{p}.mlp.experts.{e}", c.moe_intermediate)
        out += _mlp(c, f"{p}.mlp.shared_experts", c.moe_intermediate * c.shared_experts)
    return out + [("model.norm.weight", (c.hidden,)), ("lm_head.weight", (c.vocab, c.hidden))]


def scaled(shapes: Shapes, scale: float) -> Shapes:
    if scale == 1:
        return shapes
    return [(n, (max(1, round(s[0] * scale)), *s[1:])) for n, s in shapes]


# the broadcast benchmark's two shape families: name -> (model it is shaped like, its config)
MODELS = {"moe": ("Qwen3-30B-A3B", QWEN3_30B_A3B), "dense": ("Qwen3-8B", QWEN3_8B)}
# the published models the cost model places the project against: name -> config
CONFIGS: dict[str, Qwen3Config | DeepseekV3Config] = {
    "Qwen3-30B-A3B": QWEN3_30B_A3B, "Qwen3-8B": QWEN3_8B, "Qwen3-235B-A22B": QWEN3_235B_A22B,
    "DeepSeek-V3": DEEPSEEK_V3, "Kimi-K2": KIMI_K2}


def shapes_of(config: Qwen3Config | DeepseekV3Config) -> Shapes:
    if isinstance(config, DeepseekV3Config):
        return deepseek_v3_shapes(config)
    return qwen3_shapes(config)


def experts_of(config: Qwen3Config | DeepseekV3Config) -> int:
    return config.routed_experts if isinstance(config, DeepseekV3Config) else config.experts


# name -> tensor list
PUBLISHED = {"Qwen3-30B-A3B": lambda: qwen3_shapes(QWEN3_30B_A3B),
             "Qwen3-235B-A22B": lambda: qwen3_shapes(QWEN3_235B_A22B),
             "DeepSeek-V3": lambda: deepseek_v3_shapes(DEEPSEEK_V3),
             "Kimi-K2": lambda: deepseek_v3_shapes(KIMI_K2)}
