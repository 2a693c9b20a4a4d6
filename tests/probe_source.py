"""A dict weight source that records what `probe()` says at each tensor it yields (the state a
refit holds its thread in: the collector, the timer slack) and can fail at its third tensor."""

from __future__ import annotations

from collections.abc import Callable

from common.source import DictWeightSource


class ProbingSource(DictWeightSource):
    """`seen`: `probe()` at each tensor; with `fail`, raises at the third."""

    def __init__(self, tensors: dict, probe: Callable[[], object], fail: bool = False) -> None:
        super().__init__(tensors)
        self.probe, self.fail = probe, fail
        self.seen: list = []

    def iter_tensors(self, plan):
        for name, tensor in super().iter_tensors(plan):
            self.seen.append(self.probe())
            if self.fail and len(self.seen) == 3:
                raise RuntimeError("source broke")
            yield name, tensor
