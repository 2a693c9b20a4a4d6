"""The `refit` backend reaches vLLM through its plugin entry point, from this checkout."""

from __future__ import annotations

import os
import subprocess
import sys
from importlib.metadata import entry_points
from pathlib import Path

import pytest
import torch

from tests.dtensor.models import make_model

ROOT = Path(__file__).resolve().parents[2]


def test_the_installed_entry_point_is_this_checkouts_plugin() -> None:
    (ep,) = [e for e in entry_points(group="vllm.general_plugins") if e.name == "refit"]
    assert ep.value == "refit_vllm_plugin:register"  # else: `pip install -e .` again
    register = ep.load()
    assert Path(sys.modules[register.__module__].__file__).resolve() == ROOT / \
        "refit_vllm_plugin.py"
    register()
    register()  # idempotent: a second registration is a no-op
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    assert "refit" in WeightTransferEngineFactory._registry


@pytest.mark.slow
def test_a_shadowing_common_package_fails_the_engine_start_saying_so(tmp_path) -> None:
    fake = tmp_path / "shadow" / "common"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("")
    make_model("qwen3", dtype=torch.bfloat16).save_pretrained(tmp_path / "ckpt")
    script = (
        "from vllm import LLM\n"
        f"LLM(model={str(tmp_path / 'ckpt')!r}, skip_tokenizer_init=True, enforce_eager=True,"
        " max_model_len=64, kv_cache_memory_bytes=64 << 20,"
        " weight_transfer_config={'backend': 'refit'})\n")
    env = {**os.environ, "PYTHONPATH": f"{fake.parent}{os.pathsep}{ROOT}",
           "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "REFIT_DISABLE_CPU_AMX": "1",
           "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-3000:]
    assert "imports a package named 'common' from" in out and str(fake) in out, out[-3000:]
