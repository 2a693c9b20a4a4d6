"""One spawned 4-rank gloo pool for the whole Megatron test session (see pool.py)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.mcore.pool import RankPool


@pytest.fixture(scope="session")
def pool() -> Iterator[RankPool]:
    p = RankPool(4)
    yield p
    p.close()
