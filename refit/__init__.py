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

_EXPORTS = {  # module -> the public names it defines
    "refit.session": ("connect", "RefitSession"),
    "common.config": ("RefitConfig", "RefitConfigError"),
    "common.errors": ("RefitError", "RefitCommError", "PlanMismatchError",
                      "TensorMismatchError", "RefitAborted", "ConversionError"),
    "common.engine.config": ("EngineConfig",),
    "common.stats": ("RefitStats",),
    "common.dtype_policy": ("DtypePolicy",),
    "common.source": ("DictWeightSource", "WeightSource"),
    "common.plan": ("RefitPlan",),
    "common.transfer.sender": ("RefitSender",),
    "common.transfer.receiver": ("RefitReceiver",),
    "common.wire.group": ("RefitGroup",),
    "dtensor_refit": ("DTensorWeightSource",),
    "mcore_refit": ("MegatronWeightSource", "converter_for"),
    "common.clients.engine_client": ("EngineError",),
    "common.clients.fleet": ("EngineFleet",),
    "common.clients.http_engine": ("HttpEngine",),
    "common.clients.local_engine": ("LocalEngine",),
    "common.clients.ray_engine": ("RayEngine",),
    "common.clients.serve": ("VllmServer", "ServeConfig"),
}
_WHERE = {name: module for module, names in _EXPORTS.items() for name in names}
__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'refit' has no attribute {name!r}")
    value = getattr(importlib.import_module(_WHERE[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
