"""`LocalEngine` hosts a TP=2 engine: its child process may start vLLM's worker processes (a
daemonic child may not), and after refits the engine generates exactly like a fresh TP=2
engine started on the same weights (each worker applies its own shard of every tensor)."""

from __future__ import annotations

import pytest
import torch

from common.clients.local_engine import LocalEngine
from common.engine_config import EngineConfig
from tests.dtensor_vllm.helpers import LLM_KWARGS, greedy, join_one_trainer

pytestmark = pytest.mark.slow
TP2 = {**LLM_KWARGS, "tensor_parallel_size": 2}


def _save(state: dict[str, torch.Tensor] | None, path) -> str:
    from tests.dtensor.models import make_model

    model = make_model("qwen3", dtype=torch.bfloat16)
    if state is not None:
        model.load_state_dict(state)
    model.save_pretrained(str(path))
    return str(path)


def test_verdict_local_engine_hosts_a_tp2_engine_that_refits_like_a_fresh_one(tmp_path):
    from tests.dtensor.models import make_model

    start = _save(None, tmp_path / "start")
    state = {k: v.clone() for k, v in make_model("qwen3", dtype=torch.bfloat16)
             .state_dict().items()}
    with LocalEngine(EngineConfig(model=start, llm_kwargs=TP2)) as engine:
        assert engine.num_workers() == 2
        before = greedy(engine)
        trainer = join_one_trainer([engine], state)
        try:
            for version in (1, 2):  # 1 learns each worker's load map, 2 applies it
                for name, t in state.items():
                    state[name] = (t.float() * 1.25).to(t.dtype) if t.dim() > 1 else t
                trainer.refit(version)
            assert engine.weight_version() == "2"
            got = greedy(engine)
        finally:
            trainer.group.destroy()
    with LocalEngine(EngineConfig(model=_save(state, tmp_path / "v2"), llm_kwargs=TP2)) as fresh:
        want = greedy(fresh)
    assert got == want, "the TP=2 engine differs from a fresh TP=2 engine on the same weights"
    assert got["tokens"] != before["tokens"]
