"""`LocalEngine` hosts a TP=2 engine: its child process may start vLLM's worker processes (a
daemonic child may not). After refits the engine generates exactly like a fresh TP=2 engine
started on the same weights (each worker applies its own shard of every tensor), and each
worker's learned map says which bytes of the refit it reads: its own shard, about half."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from common.clients.local_engine import LocalEngine
from common.engine_config import EngineConfig
from tests.dtensor_vllm.helpers import LLM_KWARGS, greedy, join_one_trainer

pytestmark = pytest.mark.slow
TP2 = {**LLM_KWARGS, "tensor_parallel_size": 2}


@dataclass
class Refitted:
    before: dict  # greedy outputs on the starting weights
    got: dict  # after the refits
    state: dict[str, torch.Tensor]  # what the last refit sent
    reports: list[dict]  # each worker's apply report
    total_bytes: int


def _save(state: dict[str, torch.Tensor] | None, path) -> str:
    from tests.dtensor.models import make_model

    model = make_model("qwen3", dtype=torch.bfloat16)
    if state is not None:
        model.load_state_dict(state)
    model.save_pretrained(str(path))
    return str(path)


@pytest.fixture(scope="module")
def refitted(tmp_path_factory) -> Refitted:
    from tests.dtensor.models import make_model

    start = _save(None, tmp_path_factory.mktemp("tp2") / "start")
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
            return Refitted(before, greedy(engine), state, engine.apply_reports(),
                            trainer.sender.plan.total_bytes)
        finally:
            trainer.group.destroy()


def test_verdict_local_engine_hosts_a_tp2_engine_that_refits_like_a_fresh_one(
        refitted, tmp_path):
    path = _save(refitted.state, tmp_path / "v2")
    with LocalEngine(EngineConfig(model=path, llm_kwargs=TP2)) as fresh:
        want = greedy(fresh)
    assert refitted.got == want, "the TP=2 engine differs from a fresh TP=2 engine"
    assert refitted.got["tokens"] != refitted.before["tokens"]


def test_shard_each_tp2_worker_needs_its_own_half_of_the_bytes(refitted):
    """The needs its map implies (`DirectLoad.needs`): different per TP rank, each about half
    of the plan's bytes (its shard of every split tensor, and the replicated norms)."""
    reports = refitted.reports
    assert [r["path"] for r in reports] == ["direct", "direct"], reports
    assert reports[0]["needs_digest"] != reports[1]["needs_digest"]
    for r in reports:
        fraction = r["needs_bytes"] / refitted.total_bytes
        assert 0.45 < fraction < 0.6, (fraction, r)
