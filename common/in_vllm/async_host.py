"""Host of one vLLM `AsyncLLM` with the `refit` backend: an engine that keeps serving.

`AsyncLLMHost` has `LLMHost`'s methods as coroutines, so as an async Ray actor
(`common.clients.ray_engine.RayEngine.start(config, serving=True)`) its generate calls run
concurrently with pause, refit and resume: requests in flight meet the pause mode the client
picked (abort, wait, keep). The engine core and its workers run in child processes of the
host's process (vLLM's multiprocess engine). It imports vllm inside its methods only.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

from common.engine.config import EngineConfig
from common.engine.state import RefitState, engine_state, resumes_after
from common.in_vllm.llm_host import completion_dict, configure_process, refit_llm_args
from common.in_vllm.replies import every_worker, expected_workers


class AsyncLLMHost:
    """One `AsyncLLM(weight_transfer_config={"backend": "refit"})`, built by `start()`."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.llm: Any = None

    async def start(self) -> int:
        """Build the engine (inside the actor's event loop); returns its worker count."""
        configure_process(self.config, in_process=False)  # AsyncLLM: its own engine core
        from vllm import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        args = AsyncEngineArgs(model=self.config.model, dtype=self.config.dtype,
                               **refit_llm_args(self.config))
        self.llm = AsyncLLM.from_engine_args(args)
        await self.llm.update_weight_version("0")  # the starting checkpoint
        return await self.num_workers()

    async def pids(self) -> list[int]:
        """This process and its descendants (vLLM's engine core and workers)."""
        import psutil

        me = psutil.Process()
        return [me.pid, *(p.pid for p in me.children(recursive=True))]

    async def num_workers(self) -> int:
        return self.llm.vllm_config.parallel_config.world_size_across_dp

    async def fp8_targets(self) -> dict | None:
        """What the checkpoint holds in block FP8 (`RefitWorkerExtension.refit_fp8_targets`)."""
        return (await self.llm.collective_rpc("refit_fp8_targets"))[0]

    async def pause(self, mode: str, clear_cache: bool) -> None:
        await self.llm.pause_generation(mode=mode, clear_cache=clear_cache)

    async def state(self) -> RefitState:
        """The engine's refit state, from every worker of every replica
        (`common.engine.state`, `common.in_vllm.replies`)."""
        return engine_state(await every_worker(self.llm, "refit_state"),
                            expected_workers(self.llm))

    async def resume(self) -> None:
        """Refused while the engine holds mixed weights or a refit is unfinished."""
        if why := (await self.state()).refusal("resume"):
            raise RuntimeError(f"engine {why}")
        await self.llm.resume_generation()

    async def is_paused(self) -> bool:
        return await self.llm.is_paused()

    async def init(self, info: dict) -> None:
        from vllm.distributed.weight_transfer.base import WeightTransferInitRequest

        await self.llm.init_weight_transfer_engine(WeightTransferInitRequest(init_info=info))

    async def start_update(self) -> None:
        await self.llm.start_weight_update()

    async def update(self, info: dict) -> None:
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        before = await self.state()
        try:
            await self.llm.update_weights(WeightTransferUpdateRequest(update_info=info))
        except Exception:  # every worker rolled back: serve again (REFIT_ROLLBACK_RESUME)
            if resumes_after(before, await self.state()) and await self.llm.is_paused():
                await self.llm.resume_generation()
            raise

    async def finish(self, version: str) -> None:
        await self.llm.finish_weight_update(weight_version=version)

    async def get_version(self) -> str:
        return await self.llm.get_weight_version()

    async def set_version(self, version: str) -> None:
        await self.llm.update_weight_version(version)

    async def generate(self, prompts: list[list[int]], max_tokens: int,
                       sampling: dict[str, Any]) -> list[dict[str, Any]]:
        """All prompts at once; each answer is its request's final output (a request paused
        in mode keep waits here until the resume)."""
        from vllm import SamplingParams

        if why := (await self.state()).refusal("serve"):
            raise RuntimeError(f"engine {why}")
        params = SamplingParams(max_tokens=max_tokens, **{"temperature": 0.0, "logprobs": 1,
                                                          **sampling})

        async def one(prompt: list[int]) -> dict[str, Any]:
            final = None
            async for out in self.llm.generate({"prompt_token_ids": prompt}, params,
                                               request_id=uuid.uuid4().hex):
                final = out
            return completion_dict(final.outputs[0])

        return list(await asyncio.gather(*(one(p) for p in prompts)))

    async def stop(self) -> None:
        if self.llm is not None:
            self.llm.shutdown()
            self.llm = None
