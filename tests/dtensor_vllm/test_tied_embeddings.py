"""A model whose lm_head is tied to its embedding: after refits the engine must generate like a
fresh engine on the same weights, on both apply paths.

The checkpoint has no `lm_head.weight`: the refit loads the embedding, and vLLM's in-place
reload leaves the lm_head layer's own post-load processing (on CPU a prepacked copy of the
tied weight) stale unless it is redone.
"""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from common.clients.local_engine import LocalEngine
from common.engine.config import EngineConfig
from tests.dtensor_vllm.helpers import LLM_KWARGS, greedy, join_one_trainer

pytestmark = pytest.mark.slow


def _tied_checkpoint(path) -> str:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=512, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                         head_dim=32, tie_word_embeddings=True, max_position_embeddings=128)
    Qwen3ForCausalLM(config).to(torch.bfloat16).save_pretrained(str(path))
    return str(path)


@pytest.mark.parametrize("apply", ["direct", "load_weights"])
def test_a_tied_lm_head_follows_the_refit_embedding(tmp_path, apply) -> None:
    start = _tied_checkpoint(tmp_path / "start")
    state = load_file(f"{start}/model.safetensors")
    assert "lm_head.weight" not in state and "model.embed_tokens.weight" in state
    engine = LocalEngine(EngineConfig(model=start, llm_kwargs=LLM_KWARGS, apply=apply))
    try:
        before = greedy(engine)
        trainer = join_one_trainer([engine], state)
        for version in (1, 2):  # direct: 1 learns the map, 2 applies it
            for name, t in state.items():
                state[name] = (t.float() * 1.3).to(t.dtype)
            trainer.refit(version)
        got = greedy(engine)
        trainer.group.destroy()
    finally:
        engine.close()
    changed = shutil.copytree(start, tmp_path / "v2")
    save_file(state, f"{changed}/model.safetensors", metadata={"format": "pt"})
    with LocalEngine(EngineConfig(model=str(changed), llm_kwargs=LLM_KWARGS)) as fresh:
        want = greedy(fresh)
    assert got == want, "the tied lm_head went stale"
    assert got["tokens"] != before["tokens"]
