"""One spawned 5-process pool (up to 4 training ranks + 1 receiver) for the DTensor tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.dtensor.pool import DTensorPool

POOL_WORLD = 5


@pytest.fixture(scope="package")  # gone before the next package starts
def pool() -> Iterator[DTensorPool]:
    p = DTensorPool(POOL_WORLD)
    yield p
    p.close()
