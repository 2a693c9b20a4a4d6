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

    def refit_fp8_targets(self) -> dict[str, Any] | None:
        """The weights this engine's checkpoint holds in block FP8 and their format
        (`common.quant.fp8_plan.Fp8Targets` as JSON), None for an unquantized checkpoint:
        the trainers quantize those before sending (read from the checkpoint's headers)."""
        from common.quant.fp8_plan import Fp8Targets

        config = self.model_config
        if config.quantization is None:
            return None
        targets = Fp8Targets.from_checkpoint(config.model)
        return None if targets is None else targets.to_json()
