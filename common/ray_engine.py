"""`RayEngine`: a vLLM engine hosted in a Ray actor, driven through the `EngineClient` interface.

The actor is `common.vllm_host.LLMHost` (an `LLM` with the refit backend) made remote here:
this module imports ray and torch, never vllm, so a trainer (or a Ray driver) can use it.
`max_restarts=0`: a restarted actor would serve its starting checkpoint, unversioned. Killing
the actor kills an in-process worker with it (`EngineConfig.in_process_worker`, the default);
with `in_process_worker=False` vLLM's engine core and workers are the actor's children.
"""

from __future__ import annotations

from typing import Any

import ray

from common.engine import HostedEngine
from common.engine_config import EngineConfig


class RayEngine(HostedEngine):
    """An engine in the Ray actor `actor` (an `LLMHost`); see `RayEngine.start`."""

    def __init__(self, actor: Any, name: str, timeout_s: float = 120.0) -> None:
        super().__init__(name, timeout_s)
        self.actor = actor

    @classmethod
    def start(cls, config: EngineConfig, *, name: str | None = None, num_cpus: float = 1,
              timeout_s: float = 120.0, **options: Any) -> RayEngine:
        """Start the actor (`options` go to `.options()`: placement group, resources, ...) and
        wait until its engine is built, at most `config.start_timeout_s`."""
        from common.vllm_host import LLMHost

        name = name or f"ray:{config.model.rstrip('/').rsplit('/', 1)[-1]}"
        actor_cls = ray.remote(num_cpus=num_cpus, max_restarts=0)(LLMHost)
        actor = actor_cls.options(**options).remote(config)
        engine = cls(actor, name, timeout_s)
        engine._call("num_workers", config.start_timeout_s)
        return engine

    def _call(self, method: str, timeout_s: float | None = None, **kwargs: Any) -> Any:
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        return ray.get(getattr(self.actor, method).remote(**kwargs), timeout=timeout_s)

    def kill(self) -> None:
        ray.kill(self.actor, no_restart=True)

    def close(self) -> None:
        super().close()
        self.kill()
