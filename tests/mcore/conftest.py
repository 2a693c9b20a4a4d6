"""One spawned 4-rank gloo pool for the whole Megatron test session (see pool.py)."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from tests.mcore.pool import megatron_pool
from tests.pool import RankPool


@pytest.fixture(scope="package")  # gone before the next package starts
def pool() -> Iterator[RankPool]:
    # megatron-core 0.19 wraps its MoE routing in torch.compile, which fails under the CPU
    # shim's stand-ins (seen on the H200 machine): the spawned ranks start without dynamo.
    old = os.environ.get("TORCHDYNAMO_DISABLE")
    os.environ["TORCHDYNAMO_DISABLE"] = "1"
    try:
        p = megatron_pool(4)
    finally:
        if old is None:
            del os.environ["TORCHDYNAMO_DISABLE"]
        else:
            os.environ["TORCHDYNAMO_DISABLE"] = old
    yield p
    p.close()
