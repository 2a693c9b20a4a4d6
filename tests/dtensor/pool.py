"""The DTensor tests' rank pool: each job builds (and destroys) its own default group and
refit group on two fresh ports, so jobs of any shape can share the processes."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tests.multiproc import free_port
from tests.pool import RankPool


def _init(rank: int, world: int) -> None:
    import transformers  # noqa: F401 - paid once per process, not per job


class DTensorPool(RankPool):
    def __init__(self, world: int) -> None:
        super().__init__(world, _init)

    def run(self, fn: Callable, *args: Any, timeout: float = 120.0) -> list[Any]:
        """Run fn(rank, world, (port_a, port_b), *args) everywhere; results by rank."""
        return super().run(fn, (free_port(), free_port()), *args, timeout=timeout)
