"""`RefitGuard`: the `vllm serve` middleware that makes the engine itself refuse mixed weights.

Added with `--middleware common.in_vllm.serve_guard.RefitGuard` (with the worker extension
`common.in_vllm.worker_ext.RefitWorkerExtension`, which answers the workers' refit state). In
the API server, so it outlives every trainer:

- a generate route answers 503 while the engine holds a mix of versions (a refit failed
  after loading part of its bytes and was not rolled back), naming the failed and the last
  complete version, until a refit lands;
- `POST /resume` answers 409 then, and while a refit is in progress or landed unfinished;
- a `POST /update_weights` whose refit every worker rolled back resumes the engine (if it is
  paused) before its answer goes out, unless REFIT_ROLLBACK_RESUME=0.

The state is read from every worker of every data-parallel replica
(`common.in_vllm.replies`); a servable one is trusted for `TRUST_S` and forgotten whenever a
weight-transfer route passes. `GET /refit_state` answers every worker's state (the trainers'
`HttpEngine` reads it: vLLM's `/collective_rpc` answers for the first replica only).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any

from common.engine.state import RefitState, engine_state, resumes_after
from common.in_vllm.replies import every_worker, expected_workers

log = logging.getLogger(__name__)
GENERATE_ROUTES = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/responses",
                             "/inference/v1/generate"})
WEIGHT_ROUTES = frozenset({"/init_weight_transfer_engine", "/start_weight_update",
                           "/update_weights", "/finish_weight_update",
                           "/shutdown_weight_transfer_engine"})
TRUST_S = 1.0  # a servable state read this recently answers a generate without a new read
STATE_ROUTE = "/refit_state"


class RefitGuard:
    """Pure ASGI middleware (module docstring); vLLM builds it with the app."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self._known: tuple[RefitState, float] | None = None  # servable state, when read
        self._lock = asyncio.Lock()

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["method"] == "GET" and \
                scope["path"] == STATE_ROUTE:
            return await self._answer_state(scope, send)
        if scope["type"] != "http" or scope["method"] != "POST":
            return await self.app(scope, receive, send)
        path = scope["path"]
        if path in GENERATE_ROUTES:
            if why := (await self._state(scope, trust=True)).refusal("serve"):
                return await _refuse(send, 503, why)
        elif path == "/resume":
            if why := (await self._state(scope, trust=False)).refusal("resume"):
                return await _refuse(send, 409, why)
        elif path in WEIGHT_ROUTES:
            self._known = None
            if path == "/update_weights":
                return await self._update(scope, receive, send)
        return await self.app(scope, receive, send)

    async def _state(self, scope: dict, trust: bool) -> RefitState:
        """The engine's state: a servable one read within TRUST_S when `trust`, else read
        now (one read at a time; a failed read refuses, naming why)."""
        async with self._lock:
            if trust and self._known is not None and \
                    time.monotonic() - self._known[1] < TRUST_S:
                return self._known[0]
            try:
                llm = scope["app"].state.engine_client
                state = engine_state(await every_worker(llm, "refit_state"),
                                     expected_workers(llm))
            except Exception as e:  # noqa: BLE001 - no state read: nothing is served
                return RefitState(phase="mixed", why=f"its refit state could not be read "
                                  f"({type(e).__name__}: {e}); is the engine started with "
                                  f"--worker-extension-cls common.in_vllm.worker_ext."
                                  f"RefitWorkerExtension?")
            self._known = (state, time.monotonic()) if state.refusal("serve") is None else None
            return state

    async def _answer_state(self, scope: dict, send: Any) -> None:
        """GET /refit_state: {"workers": [every worker's state], "expected": their count}."""
        llm = scope["app"].state.engine_client
        try:
            body = {"workers": await every_worker(llm, "refit_state"),
                    "expected": expected_workers(llm)}
            status = 200
        except Exception as e:  # noqa: BLE001 - answered, named
            body, status = {"error": {"message": f"{type(e).__name__}: {e}"}}, 500
        await _send_json(send, status, body)

    async def _update(self, scope: dict, receive: Any, send: Any) -> None:
        """Run the refit; its answer waits until a rolled-back engine is resumed, so a
        trainer that reads it and pauses again is not resumed behind its back."""
        held: list[dict] = []

        async def hold(message: dict) -> None:
            held.append(message)

        before = await self._state(scope, trust=False)
        try:
            await self.app(scope, receive, hold)
        finally:
            await self._after_refit(scope, before)
            for message in held:
                try:
                    await send(message)
                except Exception:  # noqa: BLE001 - its trainer is gone; the engine is not
                    log.warning("the answer to POST /update_weights found no one to take it")
                    break

    async def _after_refit(self, scope: dict, before: RefitState) -> None:
        state = await self._state(scope, trust=False)
        if state.phase == "mixed":
            log.error("refit v%s failed and was not rolled back: serving and resume are "
                      "refused until a refit lands (%s)", state.failed, state.why)
        if not resumes_after(before, state):
            return
        engine = scope["app"].state.engine_client
        if await engine.is_paused():
            await engine.resume_generation()
            log.warning("refit v%s failed and every worker rolled back: serving %s again",
                        state.failed, state.label())


async def _refuse(send: Any, status: int, why: str) -> None:
    await _send_json(send, status, {"error": {"message": f"engine {why}",
                                              "type": "RefitStateError", "code": status}})


async def _send_json(send: Any, status: int, data: dict) -> None:
    body = json.dumps(data).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})
