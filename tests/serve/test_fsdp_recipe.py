"""FSDP2 trainers (torchrun, 2 gloo ranks) -> a real `vllm serve` server over HTTP: the recipe
`recipes/dtensor_fsdp_refit.py`, which asserts that after its refits the server's greedy tokens
and logprobs equal a fresh server's started on the trained weights (DCP full state dict +
save_pretrained), and that training changed what the server generates."""

from __future__ import annotations

import pytest

from tests.recipe_runner import run_recipe

pytestmark = pytest.mark.slow


def test_fsdp2_trainers_refit_a_vllm_serve_server_over_http(tmp_path) -> None:
    got, out = run_recipe("recipes/dtensor_fsdp_refit.py", "--steps", "2", "--engine", "serve",
                          "--pause", "wait", result=tmp_path / "result.json", nproc=2)
    assert got["engine"] == "serve" and got["version"] == "2"
    assert got["tokens"] == got["fresh_tokens"] and got["tokens"] != got["tokens_before"]
    for step in (1, 2):
        assert f"[recipe] step {step} loss" in out and f"refit v{step}: " in out
