"""`RayEngine`: a vLLM engine hosted in a Ray actor, driven through the `EngineClient` interface.

The actor is `common.vllm_host.LLMHost` (an `LLM` with the refit backend) or, for an engine
that keeps serving, `common.vllm_async_host.AsyncLLMHost` (an `AsyncLLM`), made remote here:
this module imports ray and torch, never vllm, so a trainer (or a Ray driver) can use it.
`max_restarts=0`: a restarted actor would serve its starting checkpoint, unversioned. Killing
the actor (`ray.kill`) kills an `LLM`'s in-process worker with it, and an `AsyncLLM`'s engine
core and workers (its children) exit with it (checked by the tests).
"""

from __future__ import annotations

import contextlib
from typing import Any

import ray

from common.engine import HostedEngine
from common.engine_config import EngineConfig


class RayEngine(HostedEngine):
    """An engine in the Ray actor `actor` (an `LLMHost`); see `RayEngine.start`."""

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
        `AsyncLLM` (`AsyncLLMHost`, an async actor), whose generate calls run concurrently
        with pause / refit / resume, so requests in flight meet the pause mode. `timeout_s`
        bounds each call (default `config.call_timeout_s`); `options` go to `.options()`
        (placement group, resources, ...).
        """
        if serving:
            from common.vllm_async_host import AsyncLLMHost as host_cls
        else:
            from common.vllm_host import LLMHost as host_cls

        name = name or f"ray:{config.model.rstrip('/').rsplit('/', 1)[-1]}"
        actor = ray.remote(num_cpus=num_cpus, max_restarts=0)(host_cls).options(
            **options).remote(config)
        engine = cls(actor, name, config.call_timeout_s if timeout_s is None else timeout_s,
                     serving)
        engine._call("start" if serving else "num_workers", config.start_timeout_s)
        return engine

    def _call(self, method: str, timeout_s: float | None = None, **kwargs: Any) -> Any:
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        try:
            return ray.get(getattr(self.actor, method).remote(**kwargs), timeout=timeout_s)
        except ray.exceptions.RayTaskError as e:  # the host's own error, not Ray's traceback
            raise e.cause from e

    def kill(self) -> None:
        ray.kill(self.actor, no_restart=True)

    def close(self) -> None:
        """Shut an AsyncLLM down first (its engine core is a child of the actor), then kill."""
        super().close()
        if self.serving:
            with contextlib.suppress(Exception):
                self._call("stop", self.timeout_s)
        self.kill()
