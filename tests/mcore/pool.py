"""The Megatron tests' rank pool: each rank installs the CPU shim and joins one gloo group."""

from __future__ import annotations

from common.group import free_port
from tests.pool import RankPool


def _init(rank: int, world: int, port: int) -> None:
    import torch.distributed as dist

    from recipes import mcore_cpu_shim

    mcore_cpu_shim.install()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)


def megatron_pool(world: int = 4) -> RankPool:
    """Importing megatron-core and joining the group costs ~10 s per process: done once."""
    return RankPool(world, _init, (free_port(),))
