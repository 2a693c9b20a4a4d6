"""refit: move freshly trained weights from Megatron-Core or DTensor (FSDP2 / TP) training ranks
into running vLLM engines, every RL step.

    import refit
    session = refit.connect(source, ["http://gen-0:8000"])  # every training rank, once
    session.refit(step)                                      # every training rank, each step

The names users need live here; the internals stay in `common`, `mcore_refit` and
`dtensor_refit`. Names are imported when first used, so `import refit` never imports
megatron-core, Ray or vLLM (the DTensor path never needs megatron-core).
"""

from __future__ import annotations

import importlib
from typing import Any

_WHERE = {  # public name -> the module that defines it
    "connect": "refit.session", "RefitSession": "refit.session",
    "RefitConfig": "common.config", "RefitConfigError": "common.config",
    "EngineConfig": "common.engine_config",
    "RefitError": "common.errors", "RefitCommError": "common.errors",
    "PlanMismatchError": "common.errors", "TensorMismatchError": "common.errors",
    "RefitAborted": "common.errors", "ConversionError": "common.errors",
    "EngineError": "common.clients.engine_client", "RefitStats": "common.stats",
    "DtypePolicy": "common.dtype_policy", "DictWeightSource": "common.source",
    "WeightSource": "common.source",
    "DTensorWeightSource": "dtensor_refit", "MegatronWeightSource": "mcore_refit",
    "converter_for": "mcore_refit",
    "EngineFleet": "common.clients.fleet", "HttpEngine": "common.clients.http_engine",
    "LocalEngine": "common.clients.local_engine", "RayEngine": "common.clients.ray_engine",
    "VllmServer": "common.clients.serve", "ServeConfig": "common.clients.serve",
    "RefitSender": "common.broadcast", "RefitReceiver": "common.receiver",
    "RefitPlan": "common.plan", "RefitGroup": "common.wire.group",
}
__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'refit' has no attribute {name!r}")
    value = getattr(importlib.import_module(_WHERE[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
