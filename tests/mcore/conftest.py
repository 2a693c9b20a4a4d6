"""One spawned 4-rank gloo pool for the whole Megatron test session (see pool.py)."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from tests.mcore.pool import RankPool

# megatron-core 0.19 wraps its MoE routing in torch.compile, which fails under the CPU shim's
# stand-ins (seen on the H200 machine); the spawned ranks inherit this.
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")


@pytest.fixture(scope="session")
def pool() -> Iterator[RankPool]:
    p = RankPool(4)
    yield p
    p.close()
