"""The engine owns its refit state: a trainer that dies never leaves a `vllm serve` engine
serving mixed weights, and a new trainer learns the truth at join (TP=2 and TP=1 servers).

Each cycle is a new trainer process (`survive_trainer.trainer_cycle`: a new group on a fresh
port, the engine joined again, as after a crash): it records what it adopted, lands refits,
then is SIGKILLed inside the next refit at a chosen point (before its first bucket, mid-way,
after its last bucket before the status exchange, or once the refit landed on every rank
before its `finish`: the server then refuses `POST /resume`, and the next trainer's join
commits the version). Between cycles this test asks the server
itself: with the undo log (or when no byte had arrived) every worker rolled back and the
server resumed by itself, serving the last version equal to a fresh server on those weights
(tokens and logprobs: the server's own outputs at its start); without it the server refuses
`generate` (503) and `POST /resume` (409), naming the failed and the last complete version,
until the next trainer's refit lands. Even versions carry the starting weights, odd ones the
changed; every killed refit is odd, so the last complete version is always the start's.

A failed refit at TP=2 (a loader error on one worker) is followed at once by pause, refit and
resume: each call answers for itself (no reply of the failed call left queued), the refit lands.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import signal
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import requests

from common.clients.engine_client import Completion
from common.clients.fleet import EngineFleet
from common.clients.serve import VllmServer
from common.config import RefitConfig
from common.engine.state import RefitState
from common.errors import ROLLED_BACK, RefitError
from common.plan import RefitPlan
from common.source import DictWeightSource
from common.transfer.sender import RefitSender
from common.wire.group import RefitGroup, free_port
from recipes.rank_runner import run_ranks
from tests.serve.conftest import PROMPTS, SHORT, TIMEOUT_S, serve_config
from tests.serve.survive_trainer import FAULTY_EXTENSION, trainer_cycle, weights

pytestmark = pytest.mark.slow
# (undo log on, where the trainer dies); the first cycle's kill hits the first refit after
# the learning one (a new plan: every cycle that switches the undo log relearns)
CYCLES = {2: [(True, "mid_way"), (True, "before_commit"), (True, "before_first_bucket"),
              (False, "mid_way"), (False, "before_commit"), (False, "before_first_bucket"),
              (False, "before_finish")],
          1: [(True, "mid_way"), (False, "mid_way")]}


@dataclass
class Served:
    server: VllmServer
    tp: int
    before: list  # greedy outputs of the fresh server (starting weights), as `pairs`
    transport_device: str | None = None  # "cpu": a CUDA server's workers stage on the host


@pytest.fixture(scope="module", params=[2, 1], ids=["tp2", "tp1"])
def served(request, checkpoints) -> Iterator[Served]:
    tp = request.param
    config = dataclasses.replace(serve_config(checkpoints.start, f"survives-tp{tp}"),
                                 tensor_parallel_size=tp, worker_extension=FAULTY_EXTENSION)
    with VllmServer(config) as server:
        yield Served(server, tp, pairs(server.client(timeout_s=TIMEOUT_S)
                                       .generate(PROMPTS, SHORT)))


def pairs(outs: list[Completion]) -> list:
    """Completions as [tokens, logprobs] lists (as a trainer's record holds them)."""
    return [[list(o.tokens), list(o.logprobs)] for o in outs]


def _cycle(served: Served, states: list, tmp_path, undo: bool, landed: list[int],
           die: tuple[int, str] | None) -> dict:
    """One trainer process (module docstring); its record (what it adopted, its outputs)."""
    fleet = EngineFleet([served.server.client()])
    out = tmp_path / f"cycle-{uuid.uuid4().hex[:8]}.json"
    result = run_ranks(trainer_cycle, 1, served.server.url, states, undo, landed, die,
                       str(out), served.transport_device, timeout=TIMEOUT_S * 4,
                       allow_dead=die is not None,
                       group_world=fleet.world_size(1))[0]
    expected = ("dead", -signal.SIGKILL) if die is not None else "ok"
    assert result == expected or result[0] == expected, result
    record = json.loads(out.read_text())
    assert record["outputs"] == served.before, f"after v{landed[-1]}: {record}"
    assert record["version"] == str(landed[-1])
    return record


def _settled(served: Served) -> RefitState:
    """The server's state once the killed trainer's refit has ended on its workers."""
    client = served.server.client(timeout_s=TIMEOUT_S)
    deadline = time.monotonic() + TIMEOUT_S
    while (state := client.engine_state()).phase == "refitting" and \
            time.monotonic() < deadline:
        time.sleep(0.5)
    return state


def _check_after_kill(served: Served, undo: bool, point: str, killed: int,
                      last: int) -> RefitState:
    """What the server does on its own after its trainer died in refit `killed`."""
    state, url = _settled(served), served.server.url
    client = served.server.client(timeout_s=TIMEOUT_S)
    if point == "before_finish":  # landed on every worker, never committed: no resume
        assert (state.phase, state.landed, state.version) == ("landed", killed, last), state
        answer = requests.post(url + "/resume", timeout=TIMEOUT_S)
        assert answer.status_code == 409 and "not finished" in answer.text, answer.text
        assert client.is_paused() and client.weight_version() == str(last)
        return state
    assert state.failed == killed and state.version == last, state
    if undo or point == "before_first_bucket":  # every worker restored (or held) v`last`
        assert state.phase == "rolled_back", state
        deadline = time.monotonic() + 10.0  # the guard resumes it as the refit's call ends
        while client.is_paused() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not client.is_paused(), "a rolled-back server resumes by itself"
        assert pairs(client.generate(PROMPTS, SHORT)) == served.before
    else:
        assert state.phase == "mixed", state
        for route, status in (("/inference/v1/generate", 503), ("/resume", 409)):
            body = {"token_ids": PROMPTS[0], "sampling_params": {"max_tokens": 1}}
            answer = requests.post(url + route, json=body, timeout=TIMEOUT_S)
            assert answer.status_code == status, (route, answer.status_code, answer.text)
            assert f"refit v{killed} failed" in answer.text and \
                f"last complete: v{last}" in answer.text, answer.text
        assert client.is_paused()
    assert client.weight_version() == str(last)
    return state


def test_survives_trainer_killed_mid_refit(served, checkpoints, tmp_path) -> None:
    run_cycles(served, checkpoints.states, tmp_path, CYCLES[served.tp], 0)


def run_cycles(served: Served, states: list, tmp_path, cycles: list[tuple[bool, str]],
               last: int) -> None:
    """Trainer processes killed at each (undo log, point) of `cycles` in turn, the server
    checked after each, then one that lands refits (module docstring); `last`: the version
    the server holds (0: a fresh server, whose first refit then carries v2)."""
    previous = None
    for undo, point in cycles:
        landed = [2] if last == 0 else _to_start_weights(last)
        killed = landed[-1] + 1
        t0 = time.perf_counter()
        record = _cycle(served, states, tmp_path, undo, landed, (killed, point))
        state = _check_after_kill(served, undo, point, killed, landed[-1])
        print(f"[survives] tp{served.tp} undo={undo} killed {point} in v{killed}: "
              f"{state.phase} at v{state.version} ({time.perf_counter() - t0:.1f} s)")
        if previous is not None:  # this trainer adopted what the previous one left
            _check_adopted(record, previous)
        previous, last = (killed, state), landed[-1]
        if state.phase == "landed":  # the next trainer's join commits it
            last = killed
    record = _cycle(served, states, tmp_path, True, _to_start_weights(last), None)
    _check_adopted(record, previous)


def _to_start_weights(last: int) -> list[int]:
    """Versions after `last` up to an even one (the starting weights): two, or one."""
    return [last + 1, last + 2] if last % 2 == 0 else [last + 1]


def _check_adopted(record: dict, previous: tuple) -> None:
    """A joining trainer adopts the engine's state: the version and a failure (mixed), and
    meets the server's own refusals of resume and generate while mixed."""
    killed, state = previous
    adopted = record["adopted"]
    if state.phase == "landed":  # the join committed it
        assert (adopted["state"]["phase"], adopted["version"]) == ("complete", killed), adopted
        assert adopted["failed"] is None and record["refused"] == {}, record
        return
    assert adopted["state"]["phase"] == state.phase, (adopted, state)
    assert adopted["version"] == state.version
    if state.phase == "mixed":
        assert adopted["failed"][0] == killed, adopted
        assert "HTTP 409" in record["refused"]["resume"], record["refused"]
        assert "HTTP 503" in record["refused"]["generate"], record["refused"]
    else:
        assert adopted["failed"] is None and record["refused"] == {}, record


@contextlib.contextmanager
def _trainer(served: Served, states: list, undo: bool) -> Iterator[tuple]:
    """This process as the one trainer of a new group with the TP=2 server, joined; yields
    (engine client, refit(version) that lands or raises, the even version it refit first)."""
    if served.tp != 2:
        pytest.skip("a loader error on one worker of several: the TP=2 server")
    engine = served.server.client(timeout_s=TIMEOUT_S)
    fleet, port = EngineFleet([engine]), free_port()
    joining = fleet.join_async("127.0.0.1", port, 1, timeout_s=TIMEOUT_S)
    group = RefitGroup(host="127.0.0.1", port=port, rank=0, world_size=fleet.world_size(1),
                       num_trainers=1, timeout_s=TIMEOUT_S, device="cpu")
    config = RefitConfig(bucket_bytes=16 << 10, undo_bytes=(1 << 30) if undo else 0)
    sender = RefitSender.setup(group, RefitPlan.build(DictWeightSource(states[0])
                                                      .plan_specs(), config))
    joining.result(TIMEOUT_S)

    def refit(v: int) -> None:
        fleet.refit(lambda: sender.refit(DictWeightSource(weights(states, v)), v), v,
                    group=group)

    try:
        v = engine.version + 2 - engine.version % 2  # even: the starting weights
        refit(v)  # lands (learns the map if this plan is new)
        yield engine, refit, v
    finally:
        group.destroy()


def _arm_loader_fault(served: Served, refits: int) -> None:
    """Worker 1's loads fail in the next `refits` refits (a rollback counts as one)."""
    requests.post(served.server.url + "/collective_rpc", timeout=TIMEOUT_S,
                  json={"method": "arm_loader_fault", "args": ["1", str(refits)]}
                  ).raise_for_status()


def _worker_states(served: Served) -> list[RefitState]:
    """Each worker's refit state, as it says it (vLLM's dev route `POST /collective_rpc`)."""
    answer = requests.post(served.server.url + "/collective_rpc", timeout=TIMEOUT_S,
                           json={"method": "refit_state"})
    answer.raise_for_status()
    states = [RefitState.from_dict(r) for r in answer.json()["results"]]
    assert len(states) == served.tp, states
    return states


def test_survives_loader_error_on_one_worker_then_each_call_answers_for_itself(
        served, checkpoints) -> None:
    with _trainer(served, checkpoints.states, undo=False) as (engine, refit, v):
        _arm_loader_fault(served, 1)
        with pytest.raises(RefitError, match="injected loader fault on worker 1"):
            refit(v + 1)
        assert engine.engine_state().phase == "mixed"
        engine.pause("keep")  # answers for itself: not the failed refit's queued reply
        assert engine.is_paused() and engine.weight_version() == str(v)
        refit(v + 2)
        state = engine.engine_state()
        assert (state.phase, state.version) == ("complete", v + 2), state
        assert not engine.is_paused() and engine.weight_version() == str(v + 2)
        assert pairs(engine.generate(PROMPTS, SHORT)) == served.before


def test_survives_guarantee_rolled_back_only_if_every_worker_did(served, checkpoints) -> None:
    """Issue 34 item 11, at TP=2 with the undo log: a refit that fails on worker 1 rolls back
    on both workers and the engine serves on; one whose rollback worker 1 cannot do (its
    loads fail again) is "not rolled back" on both (the engine's agreement over vLLM's own
    group) and the engine refuses to serve until a refit lands."""
    with _trainer(served, checkpoints.states, undo=True) as (engine, refit, v):
        _arm_loader_fault(served, 1)
        with pytest.raises(RefitError, match="injected loader fault on worker 1"):
            refit(v + 1)
        for worker in _worker_states(served):  # each worker's own word
            assert worker.phase == "rolled_back" and ROLLED_BACK in worker.why, worker
        assert pairs(engine.generate(PROMPTS, SHORT)) == served.before
        _arm_loader_fault(served, 2)  # the refit and its rollback
        with pytest.raises(RefitError, match="injected loader fault on worker 1"):
            refit(v + 1)
        for worker in _worker_states(served):
            assert (worker.phase, worker.failed, worker.version) == ("mixed", v + 1, v), worker
            assert "not rolled back" in worker.why, worker
        answer = requests.post(served.server.url + "/inference/v1/generate", timeout=TIMEOUT_S,
                               json={"token_ids": PROMPTS[0]})
        assert answer.status_code == 503, answer.text
        refit(v + 2)
        assert pairs(engine.generate(PROMPTS, SHORT)) == served.before
