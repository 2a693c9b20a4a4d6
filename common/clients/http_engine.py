"""`HttpEngine`: a `vllm serve` server as an `EngineClient`, over its own HTTP routes.

The server runs with VLLM_SERVER_DEV_MODE=1 (the RL routes: pause, weight transfer, weight
version), `--tokens-only` (`POST /inference/v1/generate`: the one route that reports which weight
version produced which output token) and `--weight-transfer-config '{"backend": "refit"}'`;
`common.clients.serve.VllmServer` starts one so. Only the join info and the version travel over
HTTP; the weights go over the refit group. Training-side code: never imports vllm.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import requests

from common.clients.engine_client import Completion, EngineClient, EngineError, PauseMode
from common.engine.state import RefitState, engine_state

_BODY_CHARS = 2000  # of an error response kept in the message: vLLM can send whole tracebacks
_MARGIN_S = 30.0  # beyond a join's own timeout: the route answers after the group's rendezvous
_WATCH_S = 1.0  # how often a call still outstanding looks at the server's liveness
_HEALTH_TIMEOUT_S = 2.0  # a slower /health answer says "busy", not "dead"
GENERATE = "/inference/v1/generate"


class HttpEngine(EngineClient):
    """One `vllm serve` server (every worker of it: TP x PP x DP) at `url` (module docstring).

    Each call is one plain request (no shared session: the refit runs on the client's thread
    pool while the caller pauses, generates or reads versions), bounded by `timeout_s`. While
    it is outstanding the server's liveness is watched every second: vLLM's engine-dead
    signal (`GET /health` -> 503, as soon as its engine core died), refused connections, and
    `alive()` when given (e.g. `VllmServer.client()`: whether the server process exited,
    returning why, else None); a dead engine fails the call at once, naming it.
    """

    def __init__(self, url: str, name: str | None = None, timeout_s: float = 60.0,
                 alive: Callable[[], str | None] | None = None) -> None:
        super().__init__(name or url.rstrip("/"), timeout_s)
        self.url, self.alive = url.rstrip("/"), alive
        self._version_routes: bool | None = None  # whether the server has /weight_info

    def _call(self, method: str, route: str, timeout_s: float | None = None,
              **kwargs: Any) -> requests.Response:
        """One request, the server's liveness watched meanwhile (class docstring); any
        failure raises naming the engine, method, route, status and body."""
        timeout = self.timeout_s if timeout_s is None else timeout_s
        box: dict[str, Any] = {}
        done = threading.Event()

        def request() -> None:
            try:
                box["response"] = self._request(method, route, timeout, **kwargs)
            except BaseException as e:  # noqa: BLE001 - raised by the caller's thread
                box["error"] = e
            finally:
                done.set()

        threading.Thread(target=request, name=f"{self.name} {method} {route}",
                         daemon=True).start()  # daemon: a dead server's socket may hang
        while not done.wait(_WATCH_S):
            if why := self.dead():
                raise EngineError(f"engine {self.name}: {method} {route} abandoned: the engine "
                                  f"died ({why})")
        if "error" in box:
            raise box["error"]
        return box["response"]

    def dead(self) -> str | None:
        """Why the server is dead, or None while it lives (or only answers slowly)."""
        if self.alive is not None and (why := self.alive()):
            return why
        try:
            status = requests.get(self.url + "/health", timeout=_HEALTH_TIMEOUT_S).status_code
        except requests.ConnectionError as e:
            return f"the server refuses connections: {e}"
        except requests.RequestException:
            return None
        return ("GET /health -> 503: vLLM reports its engine core dead" if status == 503
                else None)

    def _request(self, method: str, route: str, timeout: float,
                 **kwargs: Any) -> requests.Response:
        try:
            response = requests.request(method, self.url + route, timeout=timeout, **kwargs)
        except requests.RequestException as e:
            raise EngineError(f"engine {self.name}: {method} {route} failed: "
                              f"{type(e).__name__}: {e}") from e
        if response.status_code >= 400:
            body = response.text
            cut = f" ... [{len(body) - _BODY_CHARS} more chars]" if len(body) > _BODY_CHARS else ""
            # a server error is often the engine core's death reaching the API server first
            died = f" (the engine died: {why})" if response.status_code >= 500 and \
                (why := self.dead()) else ""
            raise EngineError(f"engine {self.name}: {method} {route} -> HTTP "
                              f"{response.status_code}{died}: {body[:_BODY_CHARS]}{cut}")
        return response

    def _json(self, method: str, route: str, **kwargs: Any) -> Any:
        return self._call(method, route, **kwargs).json()

    # --- EngineClient transport --------------------------------------------------------------
    def _num_workers(self) -> int:
        return int(self._json("GET", "/get_world_size", params={"include_dp": "true"})
                   ["world_size"])

    def _pause(self, mode: PauseMode, clear_cache: bool) -> None:
        # mode=wait returns only once in-flight requests have drained: self.timeout_s bounds it
        self._call("POST", "/pause", params={"mode": mode,
                                             "clear_cache": str(clear_cache).lower()})

    def _resume(self) -> None:
        self._call("POST", "/resume")

    def _init(self, info: dict[str, Any], timeout_s: float) -> None:
        # answers once every worker has joined the group (the trainers join meanwhile)
        self._call("POST", "/init_weight_transfer_engine", timeout_s + _MARGIN_S,
                   json={"init_info": info})

    def _start(self) -> None:
        self._call("POST", "/start_weight_update")

    def _update(self, info: dict[str, Any], timeout_s: float) -> None:
        # answers once the whole refit has landed (or failed) on every worker
        self._call("POST", "/update_weights", timeout_s, json={"update_info": info})

    def _finish(self, version: str) -> None:
        self._call("POST", "/finish_weight_update", json={"weight_version": version})

    def _get_version(self) -> str:
        if (info := self._weight_info()) is not None:
            return str(info["weight_version"])
        version = self._state().version  # vLLM without weight versions: the engine's record
        return "0" if version is None else str(version)

    def _set_version(self, version: str) -> None:
        if self._version_routes is None:
            self._weight_info()
        if self._version_routes:  # else the refit state's version is the engine's own
            self._call("POST", "/update_weight_version", json={"new_version": version})

    def _weight_info(self) -> dict[str, Any] | None:
        """`GET /weight_info`, or None where the server's vLLM has no weight versions (its
        404 is remembered: not asked again)."""
        if self._version_routes is False:
            return None
        try:
            info = self._json("GET", "/weight_info")
        except EngineError as e:
            if "HTTP 404" not in str(e):
                raise
            self._version_routes = False
            return None
        self._version_routes = True
        return info

    def _is_paused(self) -> bool:
        return bool(self._json("GET", "/is_paused")["is_paused"])

    def _state(self) -> RefitState:
        # the guard's route: every worker of every replica (vLLM's /collective_rpc answers
        # for the first data-parallel replica only)
        found = self._json("GET", "/refit_state")
        return engine_state(found["workers"], found["expected"])

    def _fp8_targets(self) -> dict | None:
        return self._json("POST", "/collective_rpc",
                          json={"method": "refit_fp8_targets"})["results"][0]

    # --- generation --------------------------------------------------------------------------
    def _generate(self, prompts: list[list[int]], max_tokens: int, *,
                  data_parallel_rank: int | None = None, **sampling: Any) -> list[Completion]:
        """One non-streaming request per prompt, in order (greedy, logprobs 1 by default);
        `data_parallel_rank` sends them to one DP replica (to compare replicas)."""
        out, headers = [], _dp_header(data_parallel_rank)
        for prompt in prompts:
            body = {"token_ids": list(prompt), "sampling_params": _sampling(max_tokens, sampling)}
            (choice,) = self._json("POST", GENERATE, json=body, headers=headers)["choices"]
            out.append(_completion(choice))
        return out

    def stream(self, prompt: list[int], max_tokens: int, *,
               data_parallel_rank: int | None = None, **sampling: Any) -> TokenStream:
        """A streaming request (sent now; the server answers its headers at once, even while
        paused): iterate it, or `start()` it in a thread, to follow it token by token."""
        body = {"token_ids": list(prompt), "stream": True,
                "sampling_params": _sampling(max_tokens, sampling)}
        response = self._call("POST", GENERATE, json=body, stream=True,
                              headers=_dp_header(data_parallel_rank))
        return TokenStream(self.name, response)


class TokenStream:
    """One streaming generate request, read as it arrives.

    Why: a pause only matters for a request that is really in flight, i.e. that has streamed a
    token (`first_token`); the final chunk carries the finish reason and the weight-version
    spans of the whole output (`result()`). Iterating yields each chunk's (token ids, logprobs).
    """

    def __init__(self, engine: str, response: requests.Response) -> None:
        self.engine, self.response = engine, response
        self.tokens: list[int] = []
        self.logprobs: list[float] = []
        self.finish_reason: str | None = None
        self.weight_versions: list[tuple[str, int, int]] = []
        self.first_token, self.done = threading.Event(), threading.Event()
        self.finished_at: float | None = None  # time.perf_counter() of the final chunk
        self.error: BaseException | None = None
        self._thread: threading.Thread | None = None

    def __iter__(self) -> Iterator[tuple[list[int], list[float]]]:
        try:
            for line in self.response.iter_lines(chunk_size=None):
                if not line.startswith(b"data: ") or line == b"data: [DONE]":
                    continue
                chunk = json.loads(line[len(b"data: "):])
                if "error" in chunk:
                    raise EngineError(f"engine {self.engine}: stream of {GENERATE} failed: "
                                      f"{json.dumps(chunk)[:_BODY_CHARS]}")
                for choice in chunk.get("choices") or []:  # the usage chunk has none
                    yield self._add(choice)
        except requests.RequestException as e:
            self.error = EngineError(f"engine {self.engine}: stream of {GENERATE} failed: "
                                     f"{type(e).__name__}: {e}")
            raise self.error from e
        except Exception as e:
            self.error = e  # before `done`: result() then raises it
            raise
        finally:
            self.response.close()
            self.finished_at = time.perf_counter()
            self.done.set()

    def _add(self, choice: dict[str, Any]) -> tuple[list[int], list[float]]:
        part = _completion(choice)
        self.tokens += part.tokens
        self.logprobs += part.logprobs
        if part.tokens:
            self.first_token.set()
        if choice.get("finish_reason") is not None:
            self.finish_reason, self.weight_versions = part.finish_reason, part.weight_versions
        return part.tokens, part.logprobs

    def start(self) -> TokenStream:
        """Read the whole stream in a daemon thread; `result()` waits for it."""
        def drain() -> None:
            with contextlib.suppress(Exception):  # kept in self.error, raised by result()
                for _ in self:
                    pass

        self._thread = threading.Thread(target=drain, name="token stream", daemon=True)
        self._thread.start()
        return self

    def result(self, timeout_s: float | None = None) -> Completion:
        """The whole output, once the final chunk came (read here unless `start()`ed)."""
        if self._thread is None:
            for _ in self:
                pass
        elif not self.done.wait(timeout_s):
            raise EngineError(f"engine {self.engine}: stream not finished in {timeout_s}s "
                              f"({len(self.tokens)} tokens so far)")
        if self.error is not None:
            raise self.error
        if self.finish_reason is None:
            raise EngineError(f"engine {self.engine}: stream ended without a finish reason "
                              f"after {len(self.tokens)} tokens")
        return Completion(list(self.tokens), list(self.logprobs), self.finish_reason,
                          list(self.weight_versions))


def _dp_header(rank: int | None) -> dict[str, str]:
    return {} if rank is None else {"X-data-parallel-rank": str(rank)}


def _sampling(max_tokens: int, sampling: dict[str, Any]) -> dict[str, Any]:
    return {"temperature": 0.0, "logprobs": 1, **sampling, "max_tokens": max_tokens}


def _completion(choice: dict[str, Any]) -> Completion:
    """A response choice (or one stream chunk's) as a `Completion`."""
    content = (choice.get("logprobs") or {}).get("content") or []
    spans = [(s["version"], s["start"], s["end"]) for s in choice.get("weight_versions") or []]
    return Completion(list(choice.get("token_ids") or []), [c["logprob"] for c in content],
                      choice.get("finish_reason") or "", spans)
