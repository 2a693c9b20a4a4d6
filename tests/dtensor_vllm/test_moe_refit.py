"""FSDP2 -> a real vLLM engine for MoE models: Qwen3-MoE and a DeepSeek-V3-style model.

These catch what dense models cannot: vLLM's CPU fused-MoE prepack (stale experts unless redone
after a reload) and the fp32 router `e_score_correction_bias` (it must arrive fp32). DeepSeek-V3
on CPU is exact only with the worker in the engine process (the default here).
"""

from __future__ import annotations

import pytest
import torch

from recipes.vllm_checks import compare_params
from tests.dtensor.shard import Case
from tests.dtensor_vllm.harness import initial_checkpoint, refit_round
from tests.dtensor_vllm.helpers import expected_params, greedy, start_engine

pytestmark = pytest.mark.slow
CASES = {"qwen3_moe": Case("qwen3_moe", dp=2), "deepseek_v3": Case("deepseek_v3", dp=2)}


@pytest.fixture(scope="module", params=sorted(CASES))
def arch_engine(request, tmp_path_factory):
    case = CASES[request.param]
    start = initial_checkpoint(case, tmp_path_factory.mktemp(request.param))
    with start_engine(start) as engine:
        yield case, engine


def test_moe_refits_match_a_fresh_engine_and_keep_the_router_bias_fp32(arch_engine, tmp_path):
    case, engine = arch_engine
    before = greedy(engine)
    results, answers = refit_round([engine], case, "ok", [1, 2], tmp_path)
    assert all(v == [("ok", 1), ("ok", 2)] for v in results.values()), results
    assert answers[0] == [("join", None), ("refit", 1), ("refit", 2)], answers
    want = expected_params(tmp_path / "v2")
    got = engine.read()
    with start_engine(str(tmp_path / "v2")) as fresh:
        ref = greedy(fresh)
        fresh_params = fresh.read()
    # vLLM's own layout, whatever its kernels did to it: equal to a fresh engine's, bit for bit.
    assert sorted(got) == sorted(fresh_params)
    for name, tensor in got.items():
        assert torch.equal(tensor, fresh_params[name]), f"{name} differs from a fresh engine"
    compared = compare_params(got, want)
    assert compared >= 8, f"only {compared} readable params compared"
    biases = [n for n in want if n.endswith("e_score_correction_bias")]
    assert (case.arch == "deepseek_v3") == bool(biases)
    for name in biases:
        assert got[name].dtype == torch.float32 and torch.equal(got[name], want[name]), name
        assert not torch.equal(got[name], want[name].bfloat16().float()), "bias looks bf16-rounded"
    out = greedy(engine)
    assert out == ref
    assert out["tokens"] != before["tokens"]


def test_a_bf16_router_bias_is_refused_at_join_and_the_engine_keeps_serving(arch_engine, tmp_path):
    case, engine = arch_engine
    if case.arch != "deepseek_v3":
        pytest.skip("only the DeepSeek-V3 model has an fp32 router bias")
    before, version = greedy(engine), engine.weight_version()
    results, answers = refit_round([engine], case, "bias_bf16", [3], tmp_path)
    for value in results.values():
        assert value[0][0] == "PlanMismatchError", value
        assert "e_score_correction_bias" in value[0][1] and "keeps it as float32" in value[0][1]
    assert answers[0][0][0] == "join-error" and "e_score_correction_bias" in answers[0][0][1]
    assert greedy(engine) == before and engine.weight_version() == version


def test_a_refit_aborted_before_any_load_leaves_the_engine_bit_for_bit_and_serving(
        arch_engine, tmp_path) -> None:
    """A drift in bucket 0: no worker loads a byte, so the fused experts (which vLLM's CPU
    kernels re-lay out after a load) and every other param stay as they were, and the engine
    is resumed serving its last version."""
    case, engine = arch_engine
    params, served, version = engine.read(), greedy(engine), engine.weight_version()
    step = int(version) + 1
    results, answers = refit_round([engine], case, "drift_first", [step], tmp_path)
    assert results[0][0][0] == "TensorMismatchError", results
    assert answers[0][-1][0] == "refit-error", answers
    assert f"still serves v{version}" in answers[0][-1][1], answers
    assert engine.failed is None and not engine.paused and engine.weight_version() == version
    after = engine.read()
    assert sorted(after) == sorted(params)
    changed = [n for n in params if not torch.equal(after[n], params[n])]
    assert changed == [], f"an aborted refit changed {changed}"
    assert any("experts" in n for n in params), "the fused experts are among the params read"
    assert greedy(engine) == served
