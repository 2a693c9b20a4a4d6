"""Training-side pre-flight: does a plan fit a HF checkpoint folder (names, shapes, dtypes)?

The receiver vets the plan against the checkpoint its engine started from (the same check,
in `common.in_vllm.backend`); a trainer that can see the same folder (the base model it started
from) can run the same check before it ever joins the refit group, and get every problem at
once instead of the first. Headers are read by `common.checkpoint` (no tensor data is read).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import torch

from common.checkpoint import checkpoint_tensors, plan_problems
from common.plan import TensorSpec, dtype_from_name

CheckpointSpecs = dict[str, tuple[tuple[int, ...], torch.dtype]]


def checkpoint_specs(folder: str | Path) -> CheckpointSpecs:
    """{name: (shape, torch dtype)} over every `*.safetensors` file of a checkpoint folder."""
    return {name: (tuple(int(s) for s in shape), dtype_from_name(dtype))
            for name, (shape, dtype) in checkpoint_tensors(folder).items()}


def compare_with_checkpoint(
    specs: Iterable[TensorSpec], checkpoint: CheckpointSpecs, check_dtype: bool = False
) -> list[str]:
    """Every way `specs` disagrees with `checkpoint` (`common.checkpoint.plan_problems`:
    names both ways, shapes; dtypes if asked). An empty list means the plan fits.

    Dtypes are not compared by default: a checkpoint saved from a `model.to(bf16)` model
    stores the router bias in bf16 while the refit declares it fp32 (vLLM keeps it fp32), and
    the inference dtype may differ from the stored one.
    """
    def stored(name: str) -> torch.dtype:
        return checkpoint[name][1]

    return plan_problems(specs, checkpoint, stored if check_dtype else None, "the checkpoint")
