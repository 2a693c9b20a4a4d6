"""MoE Megatron layouts (EP / ETP / PP) -> HF Qwen3-MoE: names/shapes and logits."""

from __future__ import annotations

import pytest

from tests.mcore.hfcheck import check
from tests.mcore.models import Layout
from tests.mcore.ranks import refit_job

MOE = [
    Layout("qwen3_moe", ep=2),
    Layout("qwen3_moe", ep=4),
    Layout("qwen3_moe", tp=2, ep=2),
    Layout("qwen3_moe", tp=2, ep=2, etp=1),
    Layout("qwen3_moe", pp=2, ep=2, tied=True),
    Layout("qwen3_moe", tp=2, ep=4, etp=1, tied=True),
]


@pytest.mark.parametrize("layout", MOE, ids=lambda lay: lay.label)
def test_moe_layout_matches_transformers(pool, layout: Layout) -> None:
    results = pool.run(refit_job, layout, 5)
    diff = check(layout, results)
    assert diff <= 1e-4, f"{layout.label}: max |logits diff| {diff}"
