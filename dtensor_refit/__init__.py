"""DTensor / FSDP2 weight source: full HF-checkpoint tensors from sharded transformers models."""

from dtensor_refit.checkpoint import checkpoint_specs, compare_with_checkpoint
from dtensor_refit.layout import LayoutError, model_entries
from dtensor_refit.policy import DtypePolicy
from dtensor_refit.source import DTensorWeightSource, reshard_fsdp

__all__ = [
    "DTensorWeightSource",
    "DtypePolicy",
    "LayoutError",
    "checkpoint_specs",
    "compare_with_checkpoint",
    "model_entries",
    "reshard_fsdp",
]
