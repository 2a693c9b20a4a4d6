"""Training-side pre-flight: does a plan fit a HF checkpoint folder (names, shapes, dtypes)?

The receiver vets the plan against the checkpoint its engine started from
(`common.vllm_worker`); a trainer that can see the same folder (the base model it started
from) can run the same check before it ever joins the refit group, and get every problem at
once instead of the first. Headers are read by `common.checkpoint` (no tensor data is read).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import torch

from common.checkpoint import checkpoint_tensors
from common.plan import TensorSpec, dtype_from_name

CheckpointSpecs = dict[str, tuple[tuple[int, ...], torch.dtype]]


def checkpoint_specs(folder: str | Path) -> CheckpointSpecs:
    """{name: (shape, torch dtype)} over every `*.safetensors` file of a checkpoint folder."""
    return {name: (tuple(int(s) for s in shape), dtype_from_name(dtype))
            for name, (shape, dtype) in checkpoint_tensors(folder).items()}


def compare_with_checkpoint(
    specs: Iterable[TensorSpec], checkpoint: CheckpointSpecs, check_dtype: bool = False
) -> list[str]:
    """Every way `specs` disagrees with `checkpoint` (names both ways, shapes; dtypes if asked).

    Dtypes are not compared by default: a checkpoint saved from a `model.to(bf16)` model
    stores the router bias in bf16 while the refit declares it fp32 (vLLM keeps it fp32), and
    the inference dtype may differ from the stored one. An empty list means the plan fits.
    """
    problems: list[str] = []
    seen: set[str] = set()
    for spec in specs:
        seen.add(spec.name)
        if spec.name not in checkpoint:
            problems.append(f"{spec.name!r} is not in the checkpoint")
            continue
        shape, dtype = checkpoint[spec.name]
        if shape != spec.shape:
            problems.append(f"{spec.name!r}: shape {list(spec.shape)}, checkpoint {list(shape)}")
        elif check_dtype and dtype != spec.dtype:
            problems.append(f"{spec.name!r}: dtype {spec.dtype}, checkpoint {dtype}")
    problems += [f"checkpoint tensor {n!r} is not in the plan" for n in checkpoint
                 if n not in seen]
    return problems
