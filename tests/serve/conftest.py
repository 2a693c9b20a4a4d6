"""One `vllm serve` server on a tiny Qwen3, refit over HTTP from this test process (rank 0).

On a 2-core machine (that others share) at most one engine of these tests runs at a time: the
fresh reference engine on the changed checkpoint runs and stops before the shared server
starts. A fresh reference is an in-process `LLM` with the server's engine settings
(`fresh_outputs`): its greedy tokens and logprobs equal a fresh `vllm serve` server's, bit for
bit, at a fraction of a server's start (one process, vLLM preloaded, against three importing
it).
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from common.clients.engine_client import Completion, PauseMode
from common.clients.fleet import EngineFleet
from common.clients.http_engine import HttpEngine
from common.clients.serve import ServeConfig, VllmServer
from common.config import RefitConfig
from common.plan import RefitPlan
from common.source import DictWeightSource
from common.transfer.sender import RefitSender, RefitStats
from common.wire.group import RefitGroup, free_port

MAX_MODEL_LEN = 8192  # long requests (thousands of tokens) stream for seconds
PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9], [100, 20, 30, 40]]
SHORT = 8  # tokens of each compared generation
MAX_NUM_SEQS = 8
LONG_PROMPT = [3, 1, 4, 1, 5]
LONG_S = 5.0  # how long a "long" request should stream (at the speed measured at start)
TIMEOUT_S = 60.0


@contextlib.contextmanager
def timed(what: str) -> Iterator[None]:
    t0 = time.perf_counter()
    yield
    print(f"[serve] {what}: {time.perf_counter() - t0:.2f} s", flush=True)


def save_qwen3(state: dict[str, torch.Tensor] | None, path: Path) -> None:
    """The tiny Qwen3 of tests/dtensor (bf16) with `state` loaded, by save_pretrained; its
    positions raised to MAX_MODEL_LEN (default RoPE: no weight depends on it)."""
    from tests.dtensor.models import make_model

    model = make_model("qwen3", dtype=torch.bfloat16)
    if state is not None:
        model.load_state_dict(state)
    model.config.max_position_embeddings = MAX_MODEL_LEN
    model.save_pretrained(str(path))


def serve_config(model: Path, name: str) -> ServeConfig:
    return ServeConfig(model=str(model), max_model_len=MAX_MODEL_LEN, start_timeout_s=240,
                       extra_args=("--max-num-seqs", str(MAX_NUM_SEQS)),
                       log_path=str(model.parent / f"{name}.log"))


def fresh_outputs(config: ServeConfig) -> list[Completion]:
    """Greedy outputs (PROMPTS, SHORT) of a fresh engine on `config`'s model and settings: an
    in-process `LLM` (`LocalEngine`), started, asked, stopped."""
    from common.clients.local_engine import LocalEngine
    from common.engine.config import EngineConfig

    assert config.tensor_parallel_size == config.data_parallel_size == 1, config
    engine = LocalEngine(EngineConfig(model=config.model, llm_kwargs={
        "kv_cache_memory_bytes": config.kv_cache_memory_bytes,
        "max_model_len": config.max_model_len, "max_num_seqs": MAX_NUM_SEQS}))
    try:
        return engine.generate(PROMPTS, SHORT)
    finally:
        engine.close()


@dataclass
class Checkpoints:
    start: Path  # the shared server starts here
    changed: Path  # every 2-D tensor x1.5: what refit v1 sends
    states: list[dict[str, torch.Tensor]]  # [start, changed]


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory) -> Checkpoints:
    from tests.dtensor.models import make_model

    root = tmp_path_factory.mktemp("serve")
    start = {k: v.clone() for k, v in make_model("qwen3", dtype=torch.bfloat16)
             .state_dict().items()}
    changed = {k: v * 1.5 if v.dim() > 1 else v.clone() for k, v in start.items()}
    save_qwen3(None, root / "start")
    save_qwen3(changed, root / "changed")
    return Checkpoints(root / "start", root / "changed", [start, changed])


@pytest.fixture(scope="session")
def reference(checkpoints) -> list[Completion]:
    """Greedy outputs of a fresh engine on the changed checkpoint (`fresh_outputs`), once for
    every module that compares with them."""
    with timed("reference engine: start, generate, stop"):
        return fresh_outputs(serve_config(checkpoints.changed, "reference"))


@dataclass
class Rig:
    """The shared server, its client joined to the refit group, and the trainer's sender."""

    server: VllmServer
    engine: HttpEngine
    fleet: EngineFleet
    group: RefitGroup
    sender: RefitSender
    states: list[dict[str, torch.Tensor]]
    before: list[Completion]  # greedy outputs on the starting checkpoint
    long_tokens: int  # max_tokens of a request that streams for about LONG_S

    def next_version(self) -> int:
        return (self.engine.version or 0) + 1

    def refit(self, version: int, mode: PauseMode = "keep",
              during: Callable[[], None] | None = None) -> RefitStats:
        """`EngineFleet.refit` of `version` (odd: the changed weights, even: the starting
        ones, so each refit changes every 2-D weight); `during` runs just before the send."""
        source = DictWeightSource(self.states[version % 2])

        def send() -> RefitStats:
            if during is not None:
                during()
            return self.sender.refit(source, version)

        return self.fleet.refit(send, version, mode, group=self.group)


def _long_tokens(engine: HttpEngine) -> int:
    """max_tokens that streams for about LONG_S, timed on a 400-token stream from its send to
    its end (under load the API server can deliver a stream in late bursts)."""
    t0 = time.perf_counter()
    stream = engine.stream(LONG_PROMPT, 400, ignore_eos=True).start()
    out = stream.result(TIMEOUT_S)
    per_token = (stream.finished_at - t0) / len(out.tokens)
    n = min(MAX_MODEL_LEN - len(LONG_PROMPT) - 16, max(1000, int(LONG_S / per_token)))
    print(f"[serve] streaming: {per_token * 1e3:.2f} ms/token -> long requests of {n} tokens")
    return n


def _yield_to_the_api_server(server: VllmServer) -> None:
    """Nice (+10) every thread of the server's engine core and workers. On a loaded 2-core
    machine they otherwise keep their API server (same session: the same scheduler autogroup)
    from running while they generate, and a stream reaches the client in one burst after the
    request ended on the server (seen: 2 of 4 long requests; 0 of 4 once niced)."""
    for pid in server.group_pids():
        with contextlib.suppress(OSError):
            with open(f"/proc/{pid}/comm") as f:
                if not f.read().startswith("VLLM::"):
                    continue
            for tid in os.listdir(f"/proc/{pid}/task"):
                os.setpriority(os.PRIO_PROCESS, int(tid), 10)


@pytest.fixture(scope="module")
def rig(checkpoints, reference) -> Iterator[Rig]:
    """`reference` first: it must be stopped before this server starts."""
    server = VllmServer(serve_config(checkpoints.start, "shared"))
    try:
        with timed("shared server: start"):
            server.wait_ready()
        _yield_to_the_api_server(server)
        engine = server.client(timeout_s=TIMEOUT_S)
        fleet = EngineFleet([engine])
        before = engine.generate(PROMPTS, SHORT)
        long_tokens = _long_tokens(engine)
        port = free_port()
        with timed("join (trainer rank 0 + 1 server worker)"):
            joining = fleet.join_async("127.0.0.1", port, 1, timeout_s=TIMEOUT_S)
            group = RefitGroup(host="127.0.0.1", port=port, rank=0,
                               world_size=fleet.world_size(1), num_trainers=1,
                               timeout_s=TIMEOUT_S, device="cpu")
            plan = RefitPlan.build(DictWeightSource(checkpoints.states[0]).plan_specs(),
                                   RefitConfig(bucket_bytes=16 << 10))
            sender = RefitSender.setup(group, plan)
            joining.result(TIMEOUT_S)
        try:
            yield Rig(server, engine, fleet, group, sender, checkpoints.states, before,
                      long_tokens)
        finally:
            group.destroy()
            engine.close()
    finally:
        with timed("shared server: stop"):
            server.stop()
