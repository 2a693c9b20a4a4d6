"""The FSDP2 and Megatron recipes as their users run them (torchrun, trainers on the GPU
machine's CPU over gloo), each refitting a `vllm serve` server of the CUDA vLLM on the GPU
(its worker stages on the host) after every training step; each recipe checks itself (the
engine's greedy tokens and logprobs equal a fresh CUDA server's on the trained weights; the
Megatron one also checks vLLM's logprobs against transformers' after every step)."""

from __future__ import annotations

import importlib.util

import pytest

from recipes.megatron_refit import VLLM_TOL
from tests.recipe_runner import run_recipe

pytestmark = [pytest.mark.gpu_vllm, pytest.mark.slow]


def test_cuda_fsdp2_recipe_refits_a_cuda_server(tmp_path) -> None:
    result, out = run_recipe("recipes/dtensor_fsdp_refit.py", "--steps", "2",
                             result=tmp_path / "fsdp.json", nproc=2)
    print(f"[gpu] FSDP2 recipe:\n{out[-2500:]}")
    assert result["engine"] == "serve" and result["version"] == "2"
    assert result["tokens"] == result["fresh_tokens"] != result["tokens_before"]


def test_cuda_megatron_recipe_refits_a_cuda_server(tmp_path) -> None:
    if importlib.util.find_spec("megatron") is None:
        pytest.skip("megatron-core is not installed")
    result, out = run_recipe("recipes/megatron_refit.py", "--steps", "2",
                             result=tmp_path / "mcore.json", nproc=4)
    print(f"[gpu] Megatron TP2xPP2 recipe:\n{out[-2500:]}")
    assert result["version"] == "2" and result["tokens"] != result["tokens_before"]
    assert result["max_logprob_diff_vllm_hf"] <= VLLM_TOL, result
