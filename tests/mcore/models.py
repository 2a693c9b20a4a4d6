"""The Megatron tests' models: `recipes.mcore_configs` at its TINY sizes, plus the wrapping a
training job hands over (`wrap`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from recipes.mcore_configs import TINY, Sizes, megatron_config
from recipes.mcore_configs import Layout as ServableLayout

VOCAB, PADDED_VOCAB, HIDDEN = TINY.vocab, TINY.padded_vocab, TINY.hidden
HEADS, HEAD_DIM = TINY.heads, TINY.head_dim
SEQ = 12

@dataclass(frozen=True)
class Layout(ServableLayout):
    """The shared layout at the TINY sizes (compared with transformers only, never served)."""

    sizes: Sizes = TINY


class Wrapper(torch.nn.Module):
    """Stands in for Float16Module (which would cast to bf16/fp16): adds a `module.` level."""

    def __init__(self, module: torch.nn.Module) -> None:
        super().__init__()
        self.module = module


def wrap_chunks(layout: Layout, chunks: list[torch.nn.Module]) -> list[torch.nn.Module]:
    """Megatron DDP around a `module.` wrapper, as training jobs hand their chunks over."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    config = megatron_config(layout)
    return [DistributedDataParallel(config, DistributedDataParallelConfig(), Wrapper(c))
            for c in chunks]
