"""Writes the GPU tests' starting checkpoints into a folder (`python -m
tests.gpu_vllm.checkpoints DIR`), for a GPU machine without transformers: carry DIR and set
REFIT_GPU_CHECKPOINTS=DIR there."""

from __future__ import annotations

import sys
from pathlib import Path

from tests.dtensor.shard import Case
from tests.dtensor_vllm.harness import initial_checkpoint
from tests.gpu_vllm.test_cuda_engine import ARCHS, checkpoint_name

if __name__ == "__main__":
    root = Path(sys.argv[1])
    for arch, tie in ARCHS.values():
        print(initial_checkpoint(Case(arch, tie=tie), root / checkpoint_name(arch, tie)))
