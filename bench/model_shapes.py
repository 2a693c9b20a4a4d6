"""Tensor lists shaped like real checkpoints (HF names and shapes), for the broadcast benchmark.

The refit's cost depends on the tensor count and size mix as much as on the bytes: an MoE
checkpoint is ~19k mostly small tensors, a dense one a few hundred large ones. `scale` shrinks
every tensor's first dimension (at least 1 row) so a list fits a smaller machine while keeping
its count and order; the shapes come from the models' published configs.
"""

from __future__ import annotations

from dataclasses import dataclass

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


QWEN3_30B_A3B = Qwen3Config(layers=48, hidden=2048, heads=32, kv_heads=4, head_dim=128,
                            vocab=151_936, experts=128, moe_intermediate=768)
QWEN3_8B = Qwen3Config(layers=36, hidden=4096, heads=32, kv_heads=8, head_dim=128,
                       vocab=151_936, intermediate=12_288)


def _mlp(c: Qwen3Config, prefix: str, inner: int) -> Shapes:
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


def scaled(shapes: Shapes, scale: float) -> Shapes:
    if scale == 1:
        return shapes
    return [(n, (max(1, round(s[0] * scale)), *s[1:])) for n, s in shapes]


# the benchmark's two shape families: name -> (model it is shaped like, its config)
MODELS = {"moe": ("Qwen3-30B-A3B", QWEN3_30B_A3B), "dense": ("Qwen3-8B", QWEN3_8B)}
