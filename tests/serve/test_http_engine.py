"""Refit into a real `vllm serve` server over HTTP (`HttpEngine`, `VllmServer`): the weights
take effect exactly, versions are tracked per output token, and the three pause modes treat a
request in flight as documented. One shared server (conftest.py); durations are printed (-s).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import requests

from common.clients.engine_client import Completion, EngineError, PauseMode
from common.clients.http_engine import TokenStream
from tests.serve.conftest import (
    LONG_PROMPT,
    MAX_MODEL_LEN,
    PROMPTS,
    SHORT,
    TIMEOUT_S,
    Rig,
    timed,
)

pytestmark = pytest.mark.slow


@dataclass
class InFlight:
    """A refit whose pause met a long request that had streamed a token (`_refit_in_flight`)."""

    stream: TokenStream
    out: Completion
    old: str  # weight version before the refit
    version: int
    marks: dict  # perf_counter() times: "pause" (sent), "paused" (returned); token counts
    tokens: int  # the request's max_tokens


def _wait_until_running(rig: Rig, stream: TokenStream) -> None:
    """Until the request has streamed a token, or the server's engine reports it running (its
    Prometheus gauge): under load the API server may hold a stream's chunks back while the
    request runs, and a pause sent then still meets it in flight."""
    deadline = time.monotonic() + TIMEOUT_S
    while not stream.first_token.wait(0.05):
        metrics = requests.get(rig.server.url + "/metrics", timeout=TIMEOUT_S).text
        if any(line.startswith("vllm:num_requests_running") and float(line.split()[-1]) > 0
               for line in metrics.splitlines()):
            return
        assert time.monotonic() < deadline and not stream.done.is_set(), \
            "the long request neither streamed a token nor ran"


def _refit_in_flight(rig: Rig, mode: PauseMode, in_flight: Callable[[Completion], bool],
                     during: Callable[[TokenStream, dict], None] | None = None) -> InFlight:
    """Refit with pause `mode` once a long request runs (`_wait_until_running`); `during`
    runs once the pause returned. On a loaded 2-core machine a
    whole request can reach the client in one late burst, after it ended on the server: not
    in flight at the pause. `in_flight`
    tells from the result; such a try is repeated with a request twice as long (3 tries; the
    speed measured at the start may have been a busier moment's), so a mode that never acts on
    a request in flight still fails."""
    tokens = rig.long_tokens
    for attempt in range(1, 4):
        old, version = rig.engine.weight_version(), rig.next_version()
        stream = rig.engine.stream(LONG_PROMPT, tokens, ignore_eos=True).start()
        _wait_until_running(rig, stream)
        marks = {"seen": len(stream.tokens), "pause": time.perf_counter()}

        def paused(stream: TokenStream = stream, marks: dict = marks) -> None:
            marks["paused"] = time.perf_counter()
            if during is not None:
                during(stream, marks)

        with timed(f"refit v{version} with pause mode {mode}"):
            rig.refit(version, mode, paused)
        out = stream.result(TIMEOUT_S)
        if in_flight(out):
            return InFlight(stream, out, old, version, marks, tokens)
        print(f"[serve] {mode}, try {attempt}: the request had ended on the server before the "
              f"pause ({out.finish_reason}, spans {out.weight_versions}); once more, longer")
        tokens = min(2 * tokens, MAX_MODEL_LEN - len(LONG_PROMPT) - 16)
    pytest.fail(f"pause mode {mode}: no try met the request in flight")


def test_refit_over_http_matches_a_fresh_server(rig: Rig, reference) -> None:
    assert rig.engine.weight_version() == "0"  # "default" at start, set to "0" by the join
    with timed("refit v1 over HTTP (pause, receive, finish, resume)"):
        stats = rig.refit(1)
    print(f"[serve] {stats.summary()}")
    assert rig.engine.weight_version() == "1" and not rig.engine.is_paused()
    got = rig.engine.generate(PROMPTS, SHORT)
    assert [c.tokens for c in got] == [c.tokens for c in reference]
    assert [c.logprobs for c in got] == [c.logprobs for c in reference]
    assert [c.tokens for c in got] != [c.tokens for c in rig.before]
    assert all(c.weight_versions == [("1", 0, SHORT)] for c in got), got
    assert all(c.finish_reason == "length" for c in got)
    with pytest.raises(EngineError, match="not newer"):
        rig.engine.refit_async(1)
    with pytest.raises(EngineError, match="pause the engine first"):
        rig.engine.refit_async(2)  # resumed: an update would race the requests
    assert rig.engine.weight_version() == "1" and not rig.engine.is_paused()


def test_http_errors_name_the_route_status_and_body(rig: Rig) -> None:
    with pytest.raises(EngineError, match=r"POST /pause -> HTTP 4\d\d: .*bogus"):
        rig.engine._pause("bogus", True)
    version = rig.engine.weight_version()
    with pytest.raises(EngineError, match=r"POST /finish_weight_update -> HTTP 5\d\d") as e:
        rig.engine._finish("99")  # no update was started: the worker refuses
    print(f"[serve] finish without start: {e.value}")
    assert rig.engine.weight_version() == version


def test_pause_abort_ends_the_request_in_flight(rig: Rig) -> None:
    run = _refit_in_flight(rig, "abort", lambda out: out.finish_reason != "length")
    out, marks = run.out, run.marks
    print(f"[serve] abort: pause returned in {marks['paused'] - marks['pause']:.3f} s; the "
          f"request ended {run.stream.finished_at - marks['pause']:.3f} s after the pause was "
          f"sent, {len(out.tokens)}/{run.tokens} tokens, spans {out.weight_versions}")
    assert out.finish_reason == "abort"
    assert len(out.tokens) < run.tokens
    assert all(span[0] == run.old for span in out.weight_versions), out.weight_versions
    (after,) = rig.engine.generate([PROMPTS[0]], SHORT)
    assert after.weight_versions == [(str(run.version), 0, SHORT)]


def test_pause_wait_drains_the_request_under_the_old_weights(rig: Rig) -> None:
    run = _refit_in_flight(rig, "wait", lambda out: True)
    out, marks, stream = run.out, run.marks, run.stream
    print(f"[serve] wait: pause returned after {marks['paused'] - marks['pause']:.2f} s "
          f"({run.tokens - marks['seen']} tokens not yet seen when it was sent); the "
          f"request's last chunk came {stream.finished_at - marks['pause']:.2f} s after it")
    assert out.finish_reason == "length" and len(out.tokens) == run.tokens
    assert out.weight_versions == [(run.old, 0, run.tokens)]
    assert stream.finished_at <= marks["paused"] + 2.0  # over when the pause returned (+ lag)
    assert rig.engine.weight_version() == str(run.version)


def _frozen(stream: TokenStream, marks: dict) -> None:
    """While paused (mode keep): once what was on the wire has arrived (no new token for
    0.5 s), the request streams nothing more."""
    seen, quiet_since = len(stream.tokens), time.perf_counter()
    while time.perf_counter() - quiet_since < 0.5 and not stream.done.is_set():
        time.sleep(0.05)
        if len(stream.tokens) != seen:
            seen, quiet_since = len(stream.tokens), time.perf_counter()
    marks["frozen"] = seen
    time.sleep(0.5)
    marks["still"] = len(stream.tokens)


def test_pause_keep_freezes_the_request_and_resumes_it_on_the_new_weights(rig: Rig) -> None:
    run = _refit_in_flight(rig, "keep", lambda out: len(out.weight_versions) > 1, _frozen)
    out, marks, new = run.out, run.marks, str(run.version)
    k = out.weight_versions[0][2]  # the server's own count of the tokens before the pause
    print(f"[serve] keep: pause returned in {marks['paused'] - marks['pause']:.3f} s, frozen at "
          f"{k} tokens ({marks['frozen']} seen while paused); the request ended "
          f"{run.stream.finished_at - marks['pause']:.2f} s after the pause was sent")
    assert marks["still"] == marks["frozen"] <= k < run.tokens  # nothing while paused
    assert out.finish_reason == "length" and len(out.tokens) == run.tokens
    assert out.weight_versions == [(run.old, 0, k), (new, k, run.tokens)]
    # clear_cache=True: the frozen request was re-prefilled under the new weights, so what
    # followed the pause is what the new weights give on the prompt + the tokens before it
    # (computed afresh: a prefix-cache hit on the request's own blocks would prove nothing).
    reset = requests.post(rig.server.url + "/reset_prefix_cache", timeout=TIMEOUT_S)
    assert reset.json() == {"success": True}, reset.text
    (fresh,) = rig.engine.generate([LONG_PROMPT + out.tokens[:k]], SHORT, ignore_eos=True)
    diff = max(abs(a - b) for a, b in zip(fresh.logprobs, out.logprobs[k:k + SHORT],
                                          strict=True))
    print(f"[serve] keep: the {SHORT} tokens after the pause vs a fresh request on the new "
          f"weights: tokens equal {fresh.tokens == out.tokens[k:k + SHORT]}, max logprob "
          f"diff {diff:.2e}")
    assert fresh.tokens == out.tokens[k:k + SHORT]
    assert diff < 1e-2


def test_kill_leaves_no_process_of_the_server(rig: Rig) -> None:
    """Last: takes the shared server down (the fixture's stop() is then a no-op)."""
    pids = rig.server.group_pids()
    assert len(pids) >= 2, pids  # the API server and its engine core at least
    with timed("kill the shared server"):
        rig.server.kill()
    assert rig.server.group_pids() == []
