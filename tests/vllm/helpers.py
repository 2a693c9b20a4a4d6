"""Shared pieces of the vLLM end-to-end tests: tiny HF models, random refits, expected params."""

from __future__ import annotations

import torch

from common.engine import LocalEngine
from common.engine_config import EngineConfig
from recipes.vllm_checks import vllm_layout

LLM_KWARGS = {"kv_cache_memory_bytes": 64 << 20, "max_model_len": 64, "max_num_seqs": 4}
PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9], [100, 20, 30, 40]]


def engine_config(model_dir: str) -> EngineConfig:
    return EngineConfig(model=model_dir, llm_kwargs=LLM_KWARGS)


def start_engine(model_dir: str) -> LocalEngine:
    """The default test engine: an in-process `LLM` with the refit backend, in a child."""
    return LocalEngine(engine_config(model_dir))


def greedy(engine, prompts=PROMPTS, max_tokens: int = 8) -> dict:
    """Tokens and logprobs of greedy completions, comparable with `==`."""
    outs = engine.generate(prompts, max_tokens)
    return {"tokens": [o.tokens for o in outs], "logprobs": [o.logprobs for o in outs]}


def expected_params(checkpoint_dir) -> dict[str, torch.Tensor]:
    """A reference checkpoint (written by save_pretrained) in vLLM's own layout."""
    from safetensors.torch import load_file

    return vllm_layout(load_file(f"{checkpoint_dir}/model.safetensors"))
