"""MoE Megatron layouts (EP / ETP / PP) -> HF Qwen3-MoE: names/shapes and logits."""

from __future__ import annotations

import pytest
import torch

from tests.mcore.hfcheck import check
from tests.mcore.models import Layout
from tests.mcore.ranks import grouped_job, refit_job

MOE = [
    Layout("qwen3_moe", ep=2),
    Layout("qwen3_moe", ep=4),
    Layout("qwen3_moe", tp=2, ep=2),
    Layout("qwen3_moe", tp=2, ep=2, etp=1),
    Layout("qwen3_moe", pp=2, ep=2, tied=True),
    Layout("qwen3_moe", tp=2, ep=4, etp=1, tied=True),
]


DSV3 = [
    Layout("deepseek_v3", tp=1),
    Layout("deepseek_v3", tp=2, ep=2, tied=True),
    Layout("deepseek_v3", pp=2, ep=2),
    Layout("deepseek_v3", tp=2, ep=4, etp=1),
]


@pytest.mark.slow
@pytest.mark.parametrize("layout", MOE + DSV3, ids=lambda lay: lay.label)
def test_moe_layout_matches_transformers(pool, layout: Layout) -> None:
    results = pool.run(refit_job, layout, 9 if layout.arch == "deepseek_v3" else 5)
    diff = check(layout, results)
    assert diff <= 1e-4, f"{layout.label}: max |logits diff| {diff}"


def test_router_bias_stays_fp32_under_bf16(pool) -> None:
    layout = Layout("deepseek_v3", tp=2, ep=2)
    results = pool.run(refit_job, layout, 4, torch.bfloat16)
    dtypes = {name: dtype for name, _, dtype, _ in results[0]["specs"]}
    bias = [n for n in dtypes if n.endswith("e_score_correction_bias")]
    assert len(bias) == 3 and all(dtypes[n] == "float32" for n in bias)
    assert all(d == "bfloat16" for n, d in dtypes.items() if n not in bias)
    sd = {k: v for r in results for k, v in r["tensors"].items()}
    assert all(sd[n].dtype == torch.float32 for n in bias)


def test_grouped_mlp_layout_gives_the_same_experts(pool) -> None:
    """Legacy GroupedMLP weight1/weight2 convert to the same HF tensors as the local experts."""
    layout = Layout("qwen3_moe", tp=2, ep=2)
    results = pool.run(grouped_job, layout, 13)
    sequential = {k: v for seq, _ in results for k, v in seq.items()}
    grouped = {k: v for _, grp in results for k, v in grp.items()}
    assert sequential.keys() == grouped.keys()
    assert any(".experts.3.up_proj" in k for k in grouped)
    for name, tensor in sequential.items():
        assert torch.equal(tensor, grouped[name]), name
