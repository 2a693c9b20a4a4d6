"""A `vllm serve` server of the CUDA vLLM (0.26: no weight-version routes) on the GPU, refit
over HTTP by trainer processes on the CPU (gloo; the server's worker stages each frame on the
host), each killed with SIGKILL inside a refit: the `-k survives` cycles of tests/serve on a
CUDA engine. With the undo log the server rolls back and resumes by itself and serves what a
fresh server on those weights serves (tokens and logprobs: its own outputs at start); without
it the server refuses generate and resume while mixed; a refit that landed but was never
finished is committed by the next trainer's join; the last trainer's refits land. The weight
version comes from the engine's refit state (no `/weight_info` in 0.26)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import pytest

from common.clients.serve import VllmServer
from tests.serve.conftest import PROMPTS, SHORT, TIMEOUT_S, serve_config
from tests.serve.survive_trainer import FAULTY_EXTENSION
from tests.serve.test_survives import Served, pairs, run_cycles

pytestmark = [pytest.mark.gpu_vllm, pytest.mark.slow]
CYCLES = [(True, "mid_way"), (False, "mid_way"), (True, "before_finish")]


@pytest.fixture(scope="module")
def cuda_served(checkpoints) -> Iterator[Served]:
    config = dataclasses.replace(serve_config(checkpoints.start, "cuda-survives"),
                                 worker_extension=FAULTY_EXTENSION)
    with VllmServer(config) as server:
        yield Served(server, 1, pairs(server.client(timeout_s=TIMEOUT_S)
                                      .generate(PROMPTS, SHORT)), transport_device="cpu")


def test_cuda_serve_survives_trainers_killed_mid_refit(cuda_served, checkpoints,
                                                       tmp_path) -> None:
    run_cycles(cuda_served, checkpoints.states, tmp_path, CYCLES, 0)
