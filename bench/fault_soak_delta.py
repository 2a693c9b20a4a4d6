"""The delta mode of the fault soak (`bench/fault_soak.py --delta`): versions that change a
few percent of the last one's elements (as RL steps do), the rollback after each failed refit
checked bit for bit, ranks that survive a death rejoin the next group with their bases, and
the tally of what each refit did (delta or whole frames, rollbacks ok / refused / wrong)."""

from __future__ import annotations

from collections import Counter, OrderedDict

import torch

UNDO_BYTES = 64 << 20  # far more than one version's ~3 MB: every failed refit can roll back
CHANGED = 0.03  # the fraction of elements a version changes
_CACHE: OrderedDict[int, dict[str, torch.Tensor]] = OrderedDict()
_CACHE_SIZE = 16


def delta_weights(version: int, first) -> dict[str, torch.Tensor]:
    """v1: `first(1)`; each later version: `CHANGED` of the last's elements changed (seeded by
    the version, so every process builds the same bytes). Not to be modified (cached)."""
    if version in _CACHE:
        _CACHE.move_to_end(version)
        return _CACHE[version]
    below = [v for v in _CACHE if v < version]
    at = max(below, default=1)
    tensors = _CACHE[at] if below else first(1)
    for v in range(at + 1, version + 1):
        g, step = torch.Generator().manual_seed(1_000_003 * v), {}
        for name, t in tensors.items():
            flat = t.reshape(-1).clone()
            pick = torch.rand(flat.numel(), generator=g) < CHANGED
            flat[pick] += torch.randn(int(pick.sum()), generator=g)
            step[name] = flat.view(t.shape)
        tensors = step
    _CACHE[version] = tensors
    while len(_CACHE) > _CACHE_SIZE:
        _CACHE.popitem(last=False)
    return tensors


def same_bytes(got: torch.Tensor, want: torch.Tensor | None) -> bool:
    if want is None or got.dtype != want.dtype or got.shape != want.shape:
        return False
    as_bytes = [t.contiguous().reshape(-1).view(torch.uint8) for t in (got, want)]
    return torch.equal(*as_bytes)


def roll_back_check(receiver, want: dict[str, torch.Tensor]) -> tuple[str, str]:
    """After a failed refit: `receiver.roll_back`, every re-applied tensor compared bit for bit
    with `want` (the last version that landed; empty: none did). ("ok", frames),
    ("refused", why) or ("wrong", what)."""
    from common.errors import RefitError

    bad: list[str] = []

    def check(items) -> None:
        bad.extend(name for name, got in items if not same_bytes(got, want.get(name)))

    try:
        frames = receiver.roll_back(check)
    except RefitError as e:
        return "refused", str(e).split("cannot roll back: ", 1)[-1][:200]
    if bad:
        return "wrong", f"{len(bad)} tensors differ from the last version that landed: {bad[:3]}"
    return "ok", str(frames)


def transplant(old, new) -> None:
    """A rank that survived a death rejoins the new group: its endpoint `new` takes over what
    `old` kept of the last version that landed (a receiver's base, a trainer's shadows)."""
    if hasattr(new, "keep_base_of"):
        new.keep_base_of(old)
    else:
        new.keep_shadows_of(old)


def reason_key(why: str) -> str:
    """A refusal's reason without its numbers (so that equal reasons count together)."""
    return "".join("N" if c.isdigit() else c for c in why.split(" (")[0])[:120]


class DeltaTally:
    """The delta mode's counts: rollbacks, and how each landed refit went (delta / whole)."""

    def __init__(self, counts: Counter, receivers: range, sources: set[int]) -> None:
        self.counts, self.receivers = counts, receivers
        self.holders = {*receivers, *sources}  # a restart of one of these makes a refit whole
        self.reasons: Counter = Counter()
        self.expect_whole = True  # no version landed yet, or a holder restarted since

    def failed(self, replies: dict[int, tuple], fault: str) -> None:
        """A refit that did not land: each surviving receiver's rollback."""
        for rank in self.receivers:
            if rank not in replies or len(replies[rank]) < 5:
                continue
            status, detail = replies[rank][4].get("rollback", ("missing", ""))
            if status == "ok":
                self.counts["rolled_back_ok"] += 1
                self.counts["rolled_back_frames"] += int(detail)
            elif status == "refused":
                self.counts["rollback_refused"] += 1
                self.reasons[f"{fault}: {reason_key(detail)}"] += 1
            else:
                self.counts[f"rollback_{status}"] += 1
                self.reasons[f"{fault}: {status}: {detail[:160]}"] += 1

    def landed(self, replies: dict[int, tuple]) -> None:
        """A refit that landed everywhere: delta frames on every receiver, or whole ones."""
        frames = [replies[r][4].get("delta_frames", 0) for r in self.receivers if r in replies]
        if frames and all(frames):
            self.counts["delta_refits"] += 1
            self.counts["delta_when_a_base_was_missing"] += self.expect_whole  # must stay 0
        elif not any(frames):
            self.counts["whole_refits"] += 1
            self.counts["whole_unexpected"] += not self.expect_whole
        else:
            self.counts["mixed_refits"] += 1
        self.expect_whole = False

    def restarted(self, fresh: list[int]) -> None:
        """`fresh` ranks started afresh: the next refit goes whole if one of them holds frames
        (a receiver, or a trainer that sources frames; another trainer reports no base)."""
        if self.holders & set(fresh):
            self.expect_whole = True
            self.counts["restarts_of_a_holder"] += 1

    def report(self) -> dict:
        c = self.counts
        c["silently_wrong"] = c["wrong_weights"] + c["rollback_wrong"]
        return {"rollback_refused_reasons": dict(self.reasons), "undo_bytes": UNDO_BYTES,
                "changed_fraction": CHANGED}
