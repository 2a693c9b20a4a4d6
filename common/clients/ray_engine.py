"""`RayEngine`: a vLLM engine hosted in a Ray actor, driven through the `EngineClient` interface.

The actor builds `common.in_vllm.llm_host.LLMHost` (an `LLM` with the refit backend) or, for an
engine that keeps serving, `common.in_vllm.async_host.AsyncLLMHost` (an `AsyncLLM`), named by
their module paths: this module imports ray and torch, never vllm nor the `in_vllm` room, so a
trainer (or a Ray driver) can use it.
`max_restarts=0`: a restarted actor would serve its starting checkpoint, unversioned. Killing
the actor (`ray.kill`) kills an `LLM`'s in-process worker with it, and an `AsyncLLM`'s engine
core and workers (its children) exit with it (checked by the tests).
"""

from __future__ import annotations

import contextlib
from typing import Any

import ray

from common.clients.local_engine import HostedEngine, by_name
from common.engine.config import EngineConfig

LLM_HOST = "common.in_vllm.llm_host:LLMHost"
ASYNC_LLM_HOST = "common.in_vllm.async_host:AsyncLLMHost"


class HostActor:
    """The actor's body: the engine host class `host` names, built inside the actor (the
    driver never imports it); its methods are called by name."""

    def __init__(self, host: str, config: EngineConfig) -> None:
        self.host = by_name(host)(config)

    def call(self, method: str, kwargs: dict[str, Any]) -> Any:
        return getattr(self.host, method)(**kwargs)


class AsyncHostActor(HostActor):
    """`HostActor` for a host whose methods are coroutines: an async actor, so generate calls
    run concurrently with pause, refit and resume."""

    async def call(self, method: str, kwargs: dict[str, Any]) -> Any:
        return await getattr(self.host, method)(**kwargs)


class RayEngine(HostedEngine):
    """An engine in the Ray actor `actor` (a `HostActor`); see `RayEngine.start`."""

    def __init__(self, actor: Any, name: str, timeout_s: float = 120.0,
                 serving: bool = False) -> None:
        super().__init__(name, timeout_s)
        self.actor, self.serving = actor, serving

    @classmethod
    def start(cls, config: EngineConfig, *, serving: bool = False, name: str | None = None,
              num_cpus: float = 1, timeout_s: float | None = None,
              **options: Any) -> RayEngine:
        """Start the actor and wait until its engine is built (`config.start_timeout_s`).

        serving=False: an offline `LLM` (`LLMHost`; one call at a time). serving=True: an
        `AsyncLLM` (`AsyncLLMHost`, in an async actor), whose generate calls run concurrently
        with pause / refit / resume, so requests in flight meet the pause mode. `timeout_s`
        bounds each call (default `config.call_timeout_s`); `options` go to `.options()`
        (placement group, resources, ...).
        """
        body, host = (AsyncHostActor, ASYNC_LLM_HOST) if serving else (HostActor, LLM_HOST)
        name = name or f"ray:{config.model.rstrip('/').rsplit('/', 1)[-1]}"
        actor = ray.remote(num_cpus=num_cpus, max_restarts=0)(body).options(
            **options).remote(host, config)
        engine = cls(actor, name, config.call_timeout_s if timeout_s is None else timeout_s,
                     serving)
        engine._call("start" if serving else "num_workers", config.start_timeout_s)
        return engine

    def _call(self, method: str, timeout_s: float | None = None, **kwargs: Any) -> Any:
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        try:
            return ray.get(self.remote(method, **kwargs), timeout=timeout_s)
        except ray.exceptions.RayTaskError as e:  # the host's own error, not Ray's traceback
            raise e.cause from e

    def remote(self, method: str, **kwargs: Any) -> Any:
        """Start `method` on the host; its Ray object ref (e.g. a generate call to collect
        later, while this engine is paused, refit and resumed)."""
        return self.actor.call.remote(method, kwargs)

    def kill(self) -> None:
        ray.kill(self.actor, no_restart=True)

    def close(self) -> None:
        """Shut an AsyncLLM down first (its engine core is a child of the actor), then kill."""
        super().close()
        if self.serving:
            with contextlib.suppress(Exception):
                self._call("stop", self.timeout_s)
        self.kill()
