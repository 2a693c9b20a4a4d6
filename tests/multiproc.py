"""What the multi-process tests share on top of `recipes.rank_runner`: outcome checks, a
receive into copies, a source that materialises each tensor."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from common.source import DictWeightSource


def expect_ok(results: dict[int, tuple[str, Any]]) -> dict[int, Any]:
    bad = {r: v for r, (s, v) in results.items() if s != "ok"}
    assert not bad, "\n".join(f"rank {r}: {v[2] if isinstance(v, tuple) else v}"
                              for r, v in bad.items())
    return {r: v for r, (_, v) in results.items()}


def receive_all(receiver: Any) -> tuple[Any, dict]:
    """One refit into a dict of copies (views die with the callback): (stats, {name: tensor})."""
    got: dict = {}
    stats = receiver.receive(lambda items: got.update({n: t.clone() for n, t in items}))
    return stats, got


class GatheringSource(DictWeightSource):
    """Yields fresh copies, like a gather that materialises each full tensor."""

    def iter_tensors(self, plan):
        for name, tensor in super().iter_tensors(plan):
            yield name, tensor.clone()


def outcome(fn: Callable[[], Any]) -> tuple[str, str]:
    """What a rank saw: ("ok", "") or the refit error's type name and message."""
    from common.errors import RefitError

    try:
        fn()
    except RefitError as e:
        return type(e).__name__, str(e)
    return "ok", ""
