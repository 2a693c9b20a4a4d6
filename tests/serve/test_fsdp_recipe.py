"""FSDP2 trainers (torchrun, 2 gloo ranks) -> a real `vllm serve` server over HTTP: the recipe
`recipes/dtensor_fsdp_refit.py`, which asserts that after its refits the server's greedy tokens
and logprobs equal a fresh server's started on the trained weights (DCP full state dict +
save_pretrained), and that training changed what the server generates."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]


def test_fsdp2_trainers_refit_a_vllm_serve_server_over_http(tmp_path) -> None:
    result = tmp_path / "result.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         "recipes/dtensor_fsdp_refit.py", "--steps", "2", "--engine", "serve",
         "--pause", "wait", "--result", str(result)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=420)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"recipe failed (rc {proc.returncode}):\n{out[-6000:]}"
    got = json.loads(result.read_text())
    assert got["engine"] == "serve" and got["version"] == "2"
    assert got["tokens"] == got["fresh_tokens"] and got["tokens"] != got["tokens_before"]
    for step in (1, 2):
        assert f"[recipe] step {step} loss" in out and f"refit v{step}: " in out
