"""Host of one vLLM `LLM` with the `refit` backend, inside the process that runs it.

`LLMHost` is what `common.clients.local_engine.LocalEngine` runs in its child process and what
`common.clients.ray_engine.RayEngine` runs as a Ray actor: vLLM's own weight-transfer methods, pause
and resume (`sleep(level=0, mode)` / `wake_up(["scheduling"])`, the offline `LLM`'s pause),
weight versions, generation and a read-back of params for tests. It imports vllm inside its
methods only: the process that builds an `LLMHost` is an engine process.
"""

from __future__ import annotations

import os
import sys
import traceback
from typing import Any

import torch

from common.engine.config import EXECUTOR, EngineConfig, cpu_bind_mask, worker_env
from common.engine.state import RefitState, engine_state, resumes_after
from common.wire.addresses import bind_process_to

_PAUSED = "engine is paused for a weight update: resume it before generating"


def configure_process(config: EngineConfig, in_process: bool) -> None:
    """The engine process's settings, before vllm is imported: whether the engine core and
    worker run in this process, threads and their cores (TP > 1 on CPU), the AMX workaround."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0" if in_process else "1"
    os.environ["OMP_NUM_THREADS"] = str(config.threads)
    os.environ.update(worker_env(config))
    if config.workers() > 1 and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = cpu_bind_mask(config.workers(),
                                                                config.threads)
    torch.set_num_threads(config.threads)
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():  # a Ray actor: vLLM binds the node's IP
        bind_process_to(ray.util.get_node_ip_address())
    if config.disable_cpu_amx:
        os.environ["REFIT_DISABLE_CPU_AMX"] = "1"  # applied by refit_vllm_plugin


def refit_llm_args(config: EngineConfig) -> dict[str, Any]:
    """`config.llm_args()`, refit's executor as its class (vLLM refuses pipeline
    parallelism to an executor given by name)."""
    args = config.llm_args()
    if args.get("distributed_executor_backend") == EXECUTOR:
        from common.in_vllm.executor import RefitMultiprocExecutor

        args["distributed_executor_backend"] = RefitMultiprocExecutor
    return args


def _read_params(worker: Any, names: list[str] | None) -> dict[str, torch.Tensor]:
    """Runs in the worker: copies of its params by vLLM name; empty params (CPU kernels
    prepack some weights and empty the param) are left out."""
    params = dict(worker.model_runner.get_model().named_parameters())
    return {n: params[n].detach().cpu().clone() for n in (names or params) if params[n].numel()}


def _backend_origin(worker: Any) -> dict[str, str]:
    """Runs in the worker: which weight-transfer backend it built, and from which files."""
    import common

    engine = worker.weight_transfer_engine
    return {"backend": f"{type(engine).__module__}.{type(engine).__name__}",
            "common": os.path.dirname(os.path.abspath(common.__file__))}


def _apply_report(worker: Any) -> dict:
    """Runs in the worker: its refit backend's apply report."""
    return dict(worker.weight_transfer_engine.apply_report)


class LLMHost:
    """One `LLM(weight_transfer_config={"backend": "refit"})`; started at version "0"."""

    def __init__(self, config: EngineConfig) -> None:
        configure_process(config, config.in_process_worker)
        from vllm import LLM

        from common.in_vllm.compat import has_weight_versions

        self.llm = LLM(model=config.model, dtype=config.dtype, **refit_llm_args(config))
        # vLLM without weight versions (0.26): the host keeps the engine's version
        self.version: str | None = None if has_weight_versions() else "0"
        self.set_version("0")  # the starting checkpoint
        self.paused = False

    def state(self) -> RefitState:
        """The engine's refit state, from its workers (`common.engine.state`)."""
        return engine_state(self.llm.collective_rpc("refit_state"), self.num_workers())

    def num_workers(self) -> int:
        return self.llm.llm_engine.vllm_config.parallel_config.world_size_across_dp

    def fp8_targets(self) -> dict | None:
        """What the checkpoint holds in block FP8 (`RefitWorkerExtension.refit_fp8_targets`)."""
        return self.llm.collective_rpc("refit_fp8_targets")[0]

    def pause(self, mode: str, clear_cache: bool) -> None:
        """An offline `LLM` has no request in flight between calls, so every mode pauses
        alike; vLLM refuses "wait" for an in-process engine core, so it pauses as "keep"."""
        self.llm.sleep(level=0, mode="abort" if mode == "abort" else "keep")
        if clear_cache:  # requests kept running would be re-prefilled under the new weights
            self.llm.reset_prefix_cache(reset_running_requests=True)
        self.paused = True

    def resume(self) -> None:
        """Refused while the engine holds mixed weights or a refit is unfinished."""
        if why := self.state().refusal("resume"):
            raise RuntimeError(f"engine {why}")
        self.llm.wake_up(tags=["scheduling"])
        self.paused = False

    def is_paused(self) -> bool:
        return self.paused

    def init(self, info: dict) -> None:
        self.llm.init_weight_transfer_engine({"init_info": info})

    def start_update(self) -> None:
        self.llm.start_weight_update()

    def update(self, info: dict) -> None:
        """One refit; one that every worker rolled back resumes the engine (unless
        REFIT_ROLLBACK_RESUME=0) before its error is raised."""
        before = self.state()
        try:
            self.llm.update_weights({"update_info": info})
        except Exception:
            if self.paused and resumes_after(before, self.state()):
                self.resume()
            raise

    def finish(self, version: str) -> None:
        if self.version is None:
            self.llm.finish_weight_update(weight_version=version)
        else:
            self.llm.finish_weight_update()
            self.version = version

    def get_version(self) -> str:
        return self.llm.get_weight_version() if self.version is None else self.version

    def set_version(self, version: str) -> None:
        if self.version is None:
            self.llm.update_weight_version(version)
        else:
            self.version = version

    def generate(self, prompts: list[list[int]], max_tokens: int,
                 sampling: dict[str, Any]) -> list[dict[str, Any]]:
        if why := self.state().refusal("serve"):
            raise RuntimeError(f"engine {why}")
        if self.paused:
            raise RuntimeError(_PAUSED)
        from vllm import SamplingParams

        params = SamplingParams(max_tokens=max_tokens, **{"temperature": 0.0, "logprobs": 1,
                                                          **sampling})
        outs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                 use_tqdm=False)
        return [completion_dict(out.outputs[0]) for out in outs]

    def backend_origin(self) -> list[dict[str, str]]:
        """Per worker: the backend class and the `common` package it came from."""
        return self.llm.collective_rpc(_backend_origin)

    def apply_reports(self) -> list[dict]:
        """Per worker: how it applies refits (path, tensors and bytes per path, why)."""
        return self.llm.collective_rpc(_apply_report)

    def shutdown(self) -> None:
        """Stop vLLM's engine core and its workers (TP > 1: their processes) cleanly."""
        self.llm.llm_engine.engine_core.shutdown()

    def read(self, names: list[str] | None, worker: int = 0) -> dict[str, torch.Tensor]:
        """A worker's params (by its index in the engine: TP rank, for TP > 1)."""
        return self.llm.collective_rpc(_read_params, args=(names,))[worker]


def completion_dict(seq: Any) -> dict[str, Any]:
    """A vLLM `CompletionOutput` as plain data (the fields of
    `common.clients.engine_client.Completion`)."""
    logprobs = [step[t].logprob for t, step in zip(seq.token_ids, seq.logprobs or [],
                                                     strict=False)]
    spans = [(s.version, s.start, s.end) for s in (getattr(seq, "weight_versions", None)
                                                    or [])]  # none in vLLM 0.26
    return {"tokens": list(seq.token_ids), "logprobs": logprobs,
            "finish_reason": str(seq.finish_reason), "weight_versions": spans}


def serve(conn: Any, config: EngineConfig) -> None:
    """Entry point of `LocalEngine`'s child process: build the host, then answer calls
    `(method, kwargs)` with `("ok", value)` or `("error", (type, message, traceback))`."""
    def fail(e: BaseException) -> None:
        conn.send(("error", (type(e).__name__, str(e), traceback.format_exc())))

    try:
        host = LLMHost(config)
    except Exception as e:  # noqa: BLE001 - reported to the driver
        fail(e)
        return
    conn.send(("ok", None))
    while True:
        try:
            method, kwargs = conn.recv()
        except EOFError:  # the trainer process is gone: shut down with it
            return
        if method == "stop":
            host.shutdown()
            # vLLM is down: leave now rather than in the interpreter's exit, which joins
            # threads and runs finalizers that vLLM or a gloo group left behind (seen waiting
            # out the caller's 30 s before its kill)
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)
        try:
            conn.send(("ok", getattr(host, method)(**kwargs)))
        except Exception as e:  # noqa: BLE001 - reported to the driver
            fail(e)
