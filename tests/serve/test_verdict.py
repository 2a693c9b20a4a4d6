"""A refit's verdict reaches every trainer rank in seconds, whoever fails (`vllm serve`, two
trainer ranks in spawned processes, a 120 s refit timeout: only the abort record, the verdict
and the HTTP client's watch of the engine's liveness can make it seconds).

- Rank 0's `fleet.refit` fails before the send (a stale version) and rank 0 keeps the group:
  rank 1, waiting in a collective, raises within 5 s with the engine's refusal.
- Only the server's EngineCore is killed once the bytes arrived (the worker's status said OK):
  both trainers raise within 5 s naming the engine (rank 0 from the dead engine's call, rank 1
  from rank 0's verdict); the server's stop leaves no process. (A replacement server taking
  over is `test_serve_failures`' kill test.)
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from common.clients.fleet import EngineFleet
from common.clients.http_engine import HttpEngine
from common.clients.serve import VllmServer
from common.config import RefitConfig
from common.plan import RefitPlan
from common.source import DictWeightSource
from common.transfer.sender import RefitSender
from common.wire.group import RefitGroup, free_port
from recipes.rank_runner import run_ranks
from tests.serve.conftest import PROMPTS, SHORT, TIMEOUT_S, serve_config

pytestmark = pytest.mark.slow
TRAINERS, REFIT_TIMEOUT_S, NOTICE_S, KEEP_S = 2, 120.0, 5.0, 12.0


@pytest.fixture(scope="module")
def server(checkpoints):
    with VllmServer(serve_config(checkpoints.start, "verdict")) as started:
        yield started


def _trainer(rank: int, world: int, port: int, url: str, rank_names: dict, state: dict,
             version: int, after_send=None, keep_s: float = 0.0) -> tuple:
    """Join the engine at `url` (rank 0 drives it), set up the sender and refit `version`
    (rank 0 through `EngineFleet.refit` with its group); `after_send` runs on rank 0 once its
    bytes went out; rank 0 keeps the group `keep_s` after its outcome. Returns (outcome,
    time.time() of the outcome)."""
    fleet = EngineFleet([HttpEngine(url, timeout_s=TIMEOUT_S)]) if rank == 0 else None
    joining = fleet.join_async("127.0.0.1", port, TRAINERS, TIMEOUT_S) if fleet else None
    group = RefitGroup(host="127.0.0.1", port=port, rank=rank, world_size=world,
                       num_trainers=TRAINERS, timeout_s=TIMEOUT_S, device="cpu",
                       rank_names=rank_names)
    source = DictWeightSource(state)
    config = RefitConfig(bucket_bytes=16 << 10, timeout_s=REFIT_TIMEOUT_S)
    sender = RefitSender.setup(group, RefitPlan.build(source.plan_specs(), config))
    if joining is not None:
        joining.result(TIMEOUT_S)

    def send():
        stats = sender.refit(source, version)
        if after_send is not None:
            after_send()
        return stats

    try:
        if fleet is not None:
            fleet.refit(send, version, group=group)
        else:
            sender.refit(source, version)
        return ("ok", ""), time.time()
    except Exception as e:  # noqa: BLE001 - compared by the test
        return (type(e).__name__, str(e)), time.time()
    finally:
        if rank == 0:
            time.sleep(keep_s)
        group.destroy()


def _stale_refit(rank: int, world: int, port: int, url: str, rank_names: dict,
                 state: dict) -> tuple:
    return _trainer(rank, world, port, url, rank_names, state, 0, keep_s=KEEP_S)


def _refit_then_kill_engine_core(rank: int, world: int, port: int, url: str, rank_names: dict,
                                 state: dict, core_pid: int) -> tuple:
    killed: list[float] = []

    def kill() -> None:
        os.kill(core_pid, signal.SIGKILL)
        killed.append(time.time())

    outcome, at = _trainer(rank, world, port, url, rank_names, state, 1,
                           kill if rank == 0 else None)
    return outcome, at, killed


def _run(server: VllmServer, fn, *args) -> dict:
    fleet = EngineFleet([server.client()])
    port = free_port()
    results = run_ranks(fn, TRAINERS, server.url, fleet.rank_names(TRAINERS), *args,
                        timeout=TIMEOUT_S * 3, port=port, group_world=fleet.world_size(TRAINERS))
    assert all(status == "ok" for status, _ in results.values()), results
    return {rank: value for rank, (_, value) in results.items()}


def test_verdict_rank0_fleet_failure_reaches_rank1_while_rank0_keeps_the_group(
        server, checkpoints):
    before = server.client().generate(PROMPTS, SHORT)
    outs = _run(server, _stale_refit, checkpoints.states[1])
    (kind0, msg0), failed_at = outs[0]
    (kind1, msg1), raised_at = outs[1]
    assert kind0 == "EngineError" and "not newer than v0" in msg0, (kind0, msg0)
    assert kind1 == "RefitCommError" and "not newer than v0" in msg1, (kind1, msg1)
    print(f"[verdict] rank 1 raised {raised_at - failed_at:.2f} s after rank 0's failure")
    assert raised_at - failed_at < NOTICE_S, (failed_at, raised_at)
    engine = server.client()  # refused before any pause: still serving its weights
    assert not engine.is_paused() and engine.weight_version() == "0"
    after = engine.generate(PROMPTS, SHORT)
    assert [(o.tokens, o.logprobs) for o in after] == [(o.tokens, o.logprobs) for o in before]


def _engine_core_pid(server: VllmServer) -> int:
    for pid in server.group_pids():
        with open(f"/proc/{pid}/cmdline", "rb") as f:  # vLLM's title: VLLM::EngineCore[_DPn]
            if f.read().startswith(b"VLLM::EngineCore"):
                return pid
    raise AssertionError(f"no VLLM::EngineCore among {server.group_pids()}")


def test_verdict_engine_core_killed_after_the_bytes_fails_every_trainer_in_seconds(
        server, checkpoints):
    outs = _run(server, _refit_then_kill_engine_core, checkpoints.states[1],
                _engine_core_pid(server))
    (killed_at,) = outs[0][2]
    for rank, ((kind, msg), at, _) in outs.items():
        print(f"[verdict] trainer {rank} raised {at - killed_at:.2f} s after the kill: {kind}")
        assert kind in ("EngineError", "RefitAborted"), (rank, kind, msg)
        assert f"engine {server.url}" in msg and "died" in msg, (rank, msg)
        assert at - killed_at < NOTICE_S, (rank, at - killed_at)
    server.stop()
    assert server.group_pids() == [], "a process of the server survived its stop()"
