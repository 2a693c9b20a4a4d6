"""Dense Megatron layouts -> HF: exact names/shapes, and transformers logits == Megatron's."""

from __future__ import annotations

import pytest
import torch

from tests.mcore.hfcheck import check
from tests.mcore.models import HEAD_DIM, HEADS, Layout
from tests.mcore.ranks import refit_job

DENSE = [
    Layout("qwen3", tp=1),
    Layout("qwen3", tp=2, tied=True),
    Layout("llama", tp=4, groups=4),
    Layout("qwen2", tp=4, groups=2),
    Layout("llama", pp=2, tied=True),
    Layout("qwen3", tp=2, pp=2),
    Layout("qwen3", pp=2, vpp=2, tied=True),
    Layout("qwen2", pp=2, vpp=2),
    Layout("qwen3", tp=2, pp=2, vpp=2, tied=True, wrap=True),
]


@pytest.mark.parametrize("layout", DENSE, ids=lambda lay: lay.label)
def test_dense_layout_matches_transformers(pool, layout: Layout) -> None:
    results = pool.run(refit_job, layout, 7)
    diff = check(layout, results)
    assert diff <= 1e-4, f"{layout.label}: max |logits diff| {diff}"


def _wrong_qkv_split(sd: dict[str, torch.Tensor]) -> None:
    """Re-fuse q/k/v as Megatron holds them, then split as if [Q; K; V] were contiguous."""
    groups = sd["model.layers.0.self_attn.k_proj.weight"].shape[0] // HEAD_DIM
    per = HEADS // groups
    for key in [k for k in sd if k.endswith("q_proj.weight")]:
        q, k, v = (sd[key.replace("q_proj", p)] for p in ("q_proj", "k_proj", "v_proj"))
        fused = torch.cat([q.reshape(groups, per * HEAD_DIM, -1), k.reshape(groups, HEAD_DIM, -1),
                           v.reshape(groups, HEAD_DIM, -1)], dim=1).reshape(-1, q.shape[1])
        nq, nk = q.shape[0], k.shape[0]
        sd[key], sd[key.replace("q_proj", "k_proj")], sd[key.replace("q_proj", "v_proj")] = (
            fused[:nq], fused[nq:nq + nk], fused[nq + nk:])


def test_wrong_qkv_split_is_caught(pool) -> None:
    layout = Layout("qwen3", tp=2)
    results = pool.run(refit_job, layout, 11)
    assert check(layout, results) <= 1e-4
    assert check(layout, results, mutate=_wrong_qkv_split) > 1e-2


def test_declared_dtype_bf16(pool) -> None:
    """Weights arrive in the declared dtype (checked against specs on every rank)."""
    layout = Layout("qwen3", tp=2, pp=2)
    results = pool.run(refit_job, layout, 3, torch.bfloat16)
    assert all(s[2] == "bfloat16" for s in results[0]["specs"])
    assert check(layout, results) < 0.5  # bf16 rounding only
