"""One spawned 4-rank gloo pool for the whole Megatron test package: each rank installs the CPU
shim and joins one gloo group once (importing megatron-core and joining cost ~10 s a process)."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from common.wire.group import free_port
from recipes.rank_runner import RankPool


def _init(rank: int, world: int, port: int) -> None:
    import torch.distributed as dist

    from recipes import mcore_cpu_shim

    mcore_cpu_shim.install()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)


@pytest.fixture(scope="package")  # gone before the next package starts
def pool() -> Iterator[RankPool]:
    # megatron-core 0.19 wraps its MoE routing in torch.compile, which fails under the CPU
    # shim's stand-ins (seen on the H200 machine): the spawned ranks start without dynamo.
    old = os.environ.get("TORCHDYNAMO_DISABLE")
    os.environ["TORCHDYNAMO_DISABLE"] = "1"
    try:
        p = RankPool(4, _init, (free_port(),))
    finally:
        if old is None:
            del os.environ["TORCHDYNAMO_DISABLE"]
        else:
            os.environ["TORCHDYNAMO_DISABLE"] = old
    yield p
    p.close()
