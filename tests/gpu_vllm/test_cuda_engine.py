"""Refits into a real CUDA vLLM engine (`pytest -m gpu_vllm` on the GPU machine; skipped
where no CUDA vLLM is importable, so `make test` on CPU never runs them).

This process is the one trainer, on the CPU over gloo; the engine (`LocalEngine`: an in-process
`LLM` in a spawned child) runs on the GPU and joins with host staging (`transport_device=
"cpu"`: each frame is copied to the GPU, then applied). Per model (a dense Qwen3, a Qwen3-MoE,
a DeepSeek-V3-style MLA model with the fp32 router bias, a Qwen3 with tied embeddings): v1
(the learning refit, vLLM's CUDA loaders), v2 (the learned map, whole frames or compact ones),
v3 (a delta), v4 fails mid-refit (a tensor drifts from the plan after buckets were applied:
every worker rolls back, the engine serves v3 again, unchanged), v5 (a delta on v3). After v5
greedy tokens and logprobs equal a fresh CUDA engine started on v5's weights, and so does every
param, bit for bit; the test prints which path each worker took and why. Unquantized layers
(all but MLA's attention) are copied straight into the serving tensors, never processed.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from common.clients.local_engine import LocalEngine
from common.engine.config import EngineConfig
from common.errors import RefitError
from recipes.engines import join_one_trainer, tiny_llm_kwargs
from tests.dtensor_vllm.helpers import DriftAt, apply_paths, greedy, perturb, same_params

pytestmark = [pytest.mark.gpu_vllm, pytest.mark.slow]
ARCHS = {"qwen3": ("qwen3", False), "qwen3_moe": ("qwen3_moe", False),
         "deepseek_v3": ("deepseek_v3", False), "tied": ("qwen3", True)}


def checkpoint(arch: str, tie: bool, path: Path) -> Path:
    """The starting checkpoint (random values set by name, as the CPU tests' trainers): a
    DeepSeek-V3 with DeepSeek's own MLA head sizes, the ones FlashAttention's MLA prefill takes
    (the CPU tests' smaller heads have no CUDA prefill backend)."""
    from transformers import AutoModelForCausalLM

    from tests.dtensor.models import make_config, random_value
    from tests.dtensor_vllm.harness import write_engine_checkpoint

    config = make_config(arch, tie)
    if arch == "deepseek_v3":
        fields = {k: v for k, v in config.to_dict().items() if k != "qk_head_dim"}
        config = type(config)(**{**fields, "qk_nope_head_dim": 128, "v_head_dim": 128})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for name, t in [*model.named_parameters(), *model.named_buffers()]:
            if "rotary" not in name:
                t.copy_(random_value(name, tuple(t.shape), 0))
    out = path / f"{arch}{'_tied' if tie else ''}"
    write_engine_checkpoint(model, out)
    return out


def _with_weights(start: Path, state: dict[str, torch.Tensor], path: Path) -> str:
    """A copy of checkpoint `start` holding `state` (for a fresh engine on those weights)."""
    from safetensors.torch import save_file

    shutil.copytree(start, path)
    save_file({k: v.contiguous() for k, v in state.items()}, str(path / "model.safetensors"),
              metadata={"format": "pt"})
    return str(path)


def _engine(model: str, **kwargs: object) -> LocalEngine:
    return LocalEngine(EngineConfig(model=model, start_method="spawn", disable_cpu_amx=False,
                                    llm_kwargs=tiny_llm_kwargs(64), **kwargs))


@pytest.mark.parametrize("name", list(ARCHS))
def test_cuda_engine_refits_learns_rolls_back_and_equals_a_fresh_engine(name, tmp_path):
    from safetensors.torch import load_file

    arch, tie = ARCHS[name]
    start = checkpoint(arch, tie, tmp_path)
    state = load_file(str(start / "model.safetensors"))
    versions = {0: dict(state)}
    for v in (1, 2, 3, 5):
        versions[v] = dict(versions[v - 1 if v != 5 else 3])
        perturb(versions[v], v)
    with _engine(_with_weights(start, versions[5], tmp_path / "v5")) as fresh:
        want, want_params = greedy(fresh), fresh.read()
    with _engine(str(start), hash_loaded=True) as engine:
        trainer = join_one_trainer([engine], dict(state), timeout_s=120, delta=True,
                                   undo_bytes=1 << 30, checksum=True,
                                   transport_device="cpu")
        try:
            for v in (1, 2, 3):
                trainer.source.tensors = versions[v]
                stats = trainer.refit(v)
                print(f"[gpu] {name} v{v}: {stats.summary()}\n  {json.dumps(apply_paths(engine))}")
            served = greedy(engine)
            if arch != "deepseek_v3":  # unquantized CUDA layers: processing keeps their bytes
                layers = engine.apply_reports()[0].get("layers", {})
                assert layers.get("copy") and not layers.get("process"), \
                    f"{name}: the learned map still processes layers on CUDA: {layers}"
            specs = trainer.sender.plan.specs
            drifted = DriftAt(versions[5], specs[len(specs) // 2].name)
            with pytest.raises(RefitError, match="the plan says bfloat16"):
                trainer.fleet.refit(lambda: trainer.sender.refit(drifted, 4), 4,
                                    group=trainer.group)
            assert engine.engine_state().phase == "rolled_back"
            assert greedy(engine) == served, f"{name}: the rollback changed what v3 serves"
            print(f"[gpu] {name} v4 rolled back: {json.dumps(apply_paths(engine))}")
            trainer.source.tensors = versions[5]
            stats = trainer.refit(5)
            print(f"[gpu] {name} v5: {stats.summary()}\n  {json.dumps(apply_paths(engine))}")
            assert greedy(engine) == want, f"{name}: v5 differs from a fresh CUDA engine"
            same_params(name, engine.read(), want_params)
        finally:
            trainer.group.destroy()
