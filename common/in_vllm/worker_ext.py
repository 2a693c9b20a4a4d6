"""`RefitWorkerExtension`: the worker methods an engine's refit guard and clients call.

vLLM mixes a worker extension into every worker (`--worker-extension-cls
common.in_vllm.worker_ext.RefitWorkerExtension`, or `worker_extension_cls=` for `LLM` /
`AsyncLLM`); its methods are reached by name through `collective_rpc` (the dev route
`POST /collective_rpc` of `vllm serve`). A framework with its own extension inherits from
this one too.
"""

from __future__ import annotations

from typing import Any


class RefitWorkerExtension:
    """Methods mixed into vLLM's worker (`self` is the worker)."""

    def refit_state(self) -> dict[str, Any]:
        """This worker's refit state (`common.engine.state.RefitState` as a dict)."""
        engine = getattr(self, "weight_transfer_engine", None)
        if engine is None or not hasattr(engine, "state"):
            raise RuntimeError(f"this worker runs no refit backend ({type(engine).__name__}): "
                               f"start the engine with weight_transfer_config "
                               f"{{'backend': 'refit'}}")
        return engine.state.as_dict()
