"""FSDP2 / TP / FSDP2 x TP over real gloo ranks: gathered, named, typed and refitted exactly."""

from __future__ import annotations

import pytest
import torch

from tests.dtensor.ranks import refit_job
from tests.dtensor.shard import Case

BF16, FP32 = torch.bfloat16, torch.float32

FAST = [
    Case("qwen3", dp=2, tie=True, forward=True),
    Case("qwen3_moe", dp=2, model_dtype=BF16),
    Case("deepseek_v3", dp=2, forward=True),
    Case("deepseek_v3", dp=2, model_dtype=BF16, bias_fp32=False),
    Case("qwen3_moe", dp=1, tp=2, out_dtype=FP32),
    Case("qwen3", dp=2, out_dtype=FP32, forward=True, mp_bf16=True),
    Case("deepseek_v3", dp=2, tp=2),
]
SLOW = [
    Case("qwen3", dp=2, tp=2),
    Case("qwen3_moe", dp=2, tp=2, model_dtype=BF16),
    Case("deepseek_v3", dp=2, out_dtype=FP32),
]


def check(results: list, case: Case) -> None:
    trainers = results[: case.trainers]
    receiver = results[case.trainers]
    assert len({r["specs"] for r in trainers}) == 1, "specs differ between training ranks"
    assert len({r["digest"] for r in trainers}) == 1
    for r in trainers:
        assert r["plan_comms"] == 0, "listing the specs ran a collective"
        assert r["none_off_source"]
    assert trainers[0]["iter_comms"] > 0, "no gather seen: is the model sharded at all?"
    assert sorted(trainers[0]["names"]) == receiver["names"]
    assert receiver["received"] == {1: len(receiver["names"]), 2: len(receiver["names"])}
    if case.forward:  # FSDP2 left the root unsharded: the source must reshard before reading
        assert trainers[0]["root_unsharded_after_forward"] == "Parameter"
    if case.arch == "deepseek_v3":
        assert trainers[0]["bias"] == ["model.layers.1.mlp.gate.e_score_correction_bias"]


@pytest.mark.parametrize("case", FAST, ids=str)
def test_refit(pool, case: Case) -> None:
    check(pool.run(refit_job, case), case)


@pytest.mark.slow
@pytest.mark.parametrize("case", SLOW, ids=str)
def test_refit_slow(pool, case: Case) -> None:
    check(pool.run(refit_job, case), case)
