"""Checks that a refit landed: vLLM's params against an HF checkpoint, bit for bit."""

from __future__ import annotations

import torch


def vllm_layout(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The HF state dict in vLLM's own stacked layout (qkv_proj, gate_up_proj, MLA's
    fused_qkv_a_proj)."""
    out: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[str, dict[int, torch.Tensor]]] = {}
    for name, t in state.items():
        if ".mlp.experts." in name:  # FusedMoE: w13 = [gate; up] per expert, w2 = down
            prefix, rest = name.split(".mlp.experts.")
            expert, proj, _ = rest.split(".")
            experts.setdefault(prefix, {}).setdefault(proj, {})[int(expert)] = t
        elif ".q_proj." in name:
            k, v = state[name.replace(".q_proj.", ".k_proj.")], state[name.replace(".q_proj.",
                                                                                   ".v_proj.")]
            out[name.replace(".q_proj.", ".qkv_proj.")] = torch.cat([t, k, v])
        elif ".q_a_proj." in name:  # MLA with a q LoRA: fused_qkv_a_proj = [q_a; kv_a]
            kv_a = state[name.replace(".q_a_proj.", ".kv_a_proj_with_mqa.")]
            out[name.replace(".q_a_proj.", ".fused_qkv_a_proj.")] = torch.cat([t, kv_a])
        elif ".gate_proj." in name and ".experts." not in name:
            up = state[name.replace(".gate_proj.", ".up_proj.")]
            out[name.replace(".gate_proj.", ".gate_up_proj.")] = torch.cat([t, up])
        elif not any(p in name for p in (".k_proj.", ".v_proj.", ".up_proj.",
                                         ".kv_a_proj_with_mqa.")) or (
                ".kv_a_proj_with_mqa." in name
                and name.replace(".kv_a_proj_with_mqa.", ".q_a_proj.") not in state):
            out[name] = t
    for prefix, projs in experts.items():
        ids = sorted(projs["gate_proj"])
        out[f"{prefix}.mlp.experts.w13_weight"] = torch.stack(
            [torch.cat([projs["gate_proj"][e], projs["up_proj"][e]]) for e in ids])
        out[f"{prefix}.mlp.experts.w2_weight"] = torch.stack([projs["down_proj"][e] for e in ids])
    return out


# Params not in checkpoint layout after loading: MLA's absorbed up-projections (derived from
# kv_b_proj) and fused-MoE experts (vLLM's CPU kernels repack them in place, same shape). The
# MoE tests compare these with a fresh engine's, bit for bit, instead.
KERNEL_LAYOUT = ("mla_attn.W_UK_T", "mla_attn.W_UV", "experts.w13_weight", "experts.w2_weight")


def compare_params(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> int:
    """Assert every readable vLLM param equals the expected value bit for bit; return the count.

    vLLM's CPU kernels prepack some weights and empty their params (which ones depends on the
    CPU's ISA), so `got` holds only the readable ones; each of them must have an expectation.
    """
    got = {n.replace(".routed_experts.", "."): t for n, t in got.items()
           if not n.endswith(KERNEL_LAYOUT)}
    assert set(got) <= set(want), f"unexpected vLLM params {sorted(set(got) - set(want))}"
    compared = 0
    for name, tensor in got.items():
        expected = want[name]
        assert tensor.dtype == expected.dtype, f"{name}: {tensor.dtype} vs {expected.dtype}"
        assert tensor.shape == expected.shape, (
            f"{name}: vLLM's param has shape {list(tensor.shape)}, the expected value "
            f"{list(expected.shape)} (a vocabulary padded on one side only?)")
        assert torch.equal(tensor, expected), f"{name} differs"
        compared += 1
    return compared
