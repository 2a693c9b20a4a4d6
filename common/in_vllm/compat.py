"""What differs between the vLLM versions refit supports (0.26 through 0.32/0.33), decided once
here by feature (what the installed vLLM has), not by version checks spread over the code.

- 0.26 names no deferred-attention test (its layerwise reload defers `Attention` and
  `MLAAttention` layers), calls the never-loaded tensors `SKIP_TENSORS` and has no
  `get_tensor_load_numel` (no loader-declared padding: a tensor loads all its elements);
- 0.26 has no weight versions: no `update_weight_version` / `get_weight_version`, and its
  `finish_weight_update()` takes no version (`HAS_WEIGHT_VERSIONS`: the hosts keep the
  engine's version themselves); outputs carry no per-token `weight_versions`;
- 0.26's engine-core client has no call that reaches every data-parallel replica
  (`common.in_vllm.replies`, which `vllm serve`'s API server imports, handles that one).
Only vLLM processes import this module.
"""

from __future__ import annotations

import torch

try:
    from vllm.model_executor.layers.attention import is_deferred_attention_layer
except ImportError:  # 0.26
    from vllm.model_executor.layers.attention import Attention, MLAAttention

    def is_deferred_attention_layer(layer: torch.nn.Module) -> bool:
        """Whether vLLM's reload processes `layer` after every other layer."""
        return isinstance(layer, (Attention, MLAAttention))

try:
    from vllm.model_executor.model_loader.reload.meta import SKIP_LOAD_TENSORS
except ImportError:  # 0.26
    from vllm.model_executor.model_loader.reload.meta import SKIP_TENSORS as SKIP_LOAD_TENSORS

try:
    from vllm.model_executor.model_loader.reload.utils import get_tensor_load_numel
except ImportError:  # 0.26

    def get_tensor_load_numel(tensor: torch.Tensor) -> int:
        """Elements a loader fills (0.26 knows no loader-declared padding)."""
        return tensor.numel()


def has_weight_versions() -> bool:
    """Whether the engine API keeps a weight version (`LLM.update_weight_version`)."""
    from vllm import LLM

    return hasattr(LLM, "update_weight_version")


__all__ = ["SKIP_LOAD_TENSORS", "get_tensor_load_numel", "has_weight_versions",
           "is_deferred_attention_layer"]
