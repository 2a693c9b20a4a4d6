"""One spawned 5-process pool (up to 4 training ranks + 1 receiver) for the DTensor tests: each
job builds (and destroys) its own default group and refit group on two fresh ports, so jobs of
any shape share the processes."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from common.wire.group import free_port
from recipes.rank_runner import RankPool

POOL_WORLD = 5


def _init(rank: int, world: int) -> None:
    import transformers  # noqa: F401 - paid once per process, not per job


class DTensorPool(RankPool):
    def __init__(self, world: int) -> None:
        super().__init__(world, _init)

    def run(self, fn: Callable, *args: Any, timeout: float = 120.0) -> list[Any]:
        """Run fn(rank, world, (port_a, port_b), *args) everywhere; results by rank."""
        return super().run(fn, (free_port(), free_port()), *args, timeout=timeout)


@pytest.fixture(scope="package")  # gone before the next package starts
def pool() -> Iterator[DTensorPool]:
    p = DTensorPool(POOL_WORLD)
    yield p
    p.close()
