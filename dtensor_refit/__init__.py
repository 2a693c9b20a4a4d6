"""DTensor / FSDP2 weight source: full HF-checkpoint tensors from sharded transformers models.

On every training rank, after `fully_shard` (and optionally `parallelize_module`):

    source = DTensorWeightSource(model, DtypePolicy(torch.bfloat16))   # once, no collective
    sender = RefitSender.setup(group, RefitPlan.build(source.plan_specs(), config))
    sender.refit(source, version)   # every rank: gathers in plan order, rank 0 sends

Pipeline stages: `DTensorWeightSource([stage_part, ...], policy)` on every rank at once (one
metadata exchange); each stage's first rank sends its tensors. Replicas (HSDP) that do not hold
a tensor's source rank run no gather. Experts split over ranks (EP) are sent by the ranks holding
them (`expert_sources="owner"`, the default; "gather" sends them from one rank).

Optionally, before joining: `compare_with_checkpoint(source.plan_specs(),
checkpoint_specs(base_model_dir))` lists every name / shape the engine's checkpoint disagrees on.
`DtypePolicy` is `common.dtype_policy.DtypePolicy` (one policy for every weight source),
re-exported here where it was first public.
"""

from common.dtype_policy import DtypePolicy
from dtensor_refit.checkpoint import checkpoint_specs, compare_with_checkpoint
from dtensor_refit.layout import LayoutError, model_entries
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
