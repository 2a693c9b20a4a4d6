"""An engine that dies after joining: every training rank raises instead of hanging."""

from __future__ import annotations

import time

import pytest
import torch

from tests.dtensor.shard import Case
from tests.dtensor_vllm.harness import initial_checkpoint, refit_round
from tests.dtensor_vllm.helpers import start_engine

pytestmark = pytest.mark.slow


def test_trainers_raise_when_the_engine_dies(tmp_path) -> None:
    case = Case("qwen3", dp=2, model_dtype=torch.float32)
    engine = start_engine(initial_checkpoint(case, tmp_path / "start"))
    t0 = time.monotonic()
    results, answers = refit_round([engine], case, "kill_engine", [1], tmp_path)
    assert answers[0] == [("join", None)], answers
    for value in results.values():
        assert value[0][0] == "RefitCommError", value
        assert "refit v1" in value[0][1] and "trainer" in value[0][1], value
    # Every trainer raises within the group's timeout (15 s here) plus start-up, and none
    # crashed: after the failure they kept their gathers on the training group in step.
    assert time.monotonic() - t0 < 90
    engine.close()
