"""What each side keeps of the frames of the last refit that landed, and of the one in flight.

A trainer keeps, per need-set, the bytes it last sent of each frame it sources (its shadow); an
engine worker keeps the bytes it last received of each of its frames (its base: model-format
bytes, whatever vLLM did to its params since). Both change only when a refit lands: during a
refit each frame's new bytes are staged (a delta frame: its delta; a whole frame: a copy of
its bytes) and `commit` applies them once the end-of-refit status says the refit landed on
every rank; `abort` drops them, so the store still holds the last complete version, the
worker can re-apply it (its rollback) and the next refit can be a delta against it.

Staging is the undo log: it is bounded by a budget. A frame staged beyond it writes through
(its entry holds the new bytes at once); so does a frame with no entry yet (the first refit
makes the base). Such a refit cannot be undone: `undoable()` says why, and `abort` then
forgets the version (the next refit goes whole).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from common.delta import codec as delta
from common.wire.transport import Transport

NOT_A_MEMBER, NO_BASE = -2, -1  # a rank's report for a need-set (else: its base version)


class FrameStore:
    """One need-set's frames (bucket index -> bytes) at `version`, on `place`."""

    def __init__(self, place: torch.device, budget: int | None, pin: bool = False) -> None:
        self.place, self.budget, self.pin = place, budget, pin  # budget None: unbounded
        self.key: str | None = None  # the frame layout the entries are for
        self.version: int | None = None  # None: the entries are not one complete version
        self.entries: dict[int, torch.Tensor] = {}
        self._staged: dict[int, tuple[bool, torch.Tensor]] = {}  # index -> (is delta, bytes)
        self.staged_bytes = 0
        self._unsafe: str | None = None

    def holds(self, key: str) -> int | None:
        """The complete version held for frame layout `key`, or None."""
        return self.version if key == self.key else None

    def begin(self, key: str, derive: Callable[[int, torch.Tensor], torch.Tensor | None]
              | None = None) -> None:
        """A refit starts: frames laid out as `key`. Another layout forgets the entries,
        unless `derive` makes each new-layout entry from its old one (None: the frame is
        not in the new layout): the version is kept."""
        if key != self.key:
            derived = None
            if derive is not None and self.version is not None:
                derived = {i: d for i, e in self.entries.items()
                           if (d := derive(i, e)) is not None}
            self.key, self.entries = key, derived or {}
            self.version = self.version if derived is not None else None
        self._staged, self.staged_bytes, self._unsafe = {}, 0, None
        if self.version is None:
            self._unsafe = "it holds no complete base yet (the first refit makes it)"

    def base(self, index: int) -> torch.Tensor | None:
        return self.entries.get(index)

    def undoable(self) -> str | None:
        """None if an abort now leaves every entry as it was; else why not."""
        return self._unsafe

    def stage_delta(self, index: int, data: torch.Tensor) -> None:
        """Frame `index` arrived as `data`, a delta on the entry (`common.delta.codec`)."""
        if self._fits(data.numel(), index):
            self._staged[index] = (True, data.to(self.place, copy=True))
        else:
            delta.apply(data.to(self.place), self.entries[index], self.version)

    def stage_whole(self, index: int, payload: torch.Tensor) -> None:
        """Frame `index` arrived whole as `payload`."""
        entry = self.entries.get(index)
        if entry is None or entry.numel() != payload.numel():
            self._unsafe = self._unsafe or f"frame {index} had no base"
            self.entries[index] = self._copy(payload)
        elif self._fits(payload.numel(), index):
            self._staged[index] = (False, self._copy(payload))
        else:
            entry.copy_(payload)

    def _fits(self, nbytes: int, index: int) -> bool:
        if self.budget is None or self.staged_bytes + nbytes <= self.budget:
            self.staged_bytes += nbytes
            return True
        self._unsafe = self._unsafe or (
            f"its undo log's budget of {self.budget} bytes was spent at frame {index} "
            f"({self.staged_bytes} staged)")
        return False

    def _copy(self, data: torch.Tensor) -> torch.Tensor:
        out = torch.empty(data.numel(), dtype=torch.uint8, device=self.place,
                          pin_memory=self.pin)
        out.copy_(data)
        return out

    def commit(self, version: int) -> None:
        """The refit landed everywhere: the entries become `version`."""
        for index, (is_delta, data) in self._staged.items():
            if is_delta:
                delta.apply(data, self.entries[index], self.version)
            else:
                self.entries[index] = data
        self.version, self._staged, self.staged_bytes, self._unsafe = version, {}, 0, None

    def abort(self) -> None:
        """The refit failed: drop what it staged; entries it wrote through make the store
        incomplete (no version: the next refit goes whole)."""
        if self._unsafe is not None:
            self.version = None
        self._staged, self.staged_bytes = {}, 0

    def nbytes(self) -> int:
        return sum(t.numel() for t in self.entries.values())


def agree_on_bases(group: Transport, reports: list[int], what: str) -> list[int | None]:
    """Per need-set, the base version every member and every trainer that sources its frames
    holds, or None (some rank lacks it: the set goes whole this refit). `reports`: this rank's
    per set, `NOT_A_MEMBER`, `NO_BASE` or a version."""
    text = ",".join(map(str, reports)).encode()
    rows = [[int(v) for v in r.decode().split(",")]
            for r in group.all_gather_bytes(text, 24 * len(reports), f"{what} delta bases")]
    out: list[int | None] = []
    for column in zip(*rows, strict=True):
        held = {v for v in column if v != NOT_A_MEMBER}
        out.append(held.pop() if len(held) == 1 and min(held) >= 0 else None)
    return out
