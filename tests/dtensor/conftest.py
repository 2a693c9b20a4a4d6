"""One spawned 5-process pool (up to 4 training ranks + 1 receiver) for the DTensor tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.dtensor.pool import RankPool

POOL_WORLD = 5


@pytest.fixture(scope="package")  # gone before the next package starts
def pool() -> Iterator[RankPool]:
    p = RankPool(POOL_WORLD)
    yield p
    p.close()
