"""Run a function on several real processes (spawned), each a rank of a real refit group."""

from __future__ import annotations

import multiprocessing as mp
import os
import time
import traceback
from collections.abc import Callable
from typing import Any

from common.group import free_port
from common.source import DictWeightSource


def _child(fn: Callable, rank: int, world_size: int, port: int, args: tuple, queue: Any) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch

    torch.set_num_threads(1)
    try:
        result = fn(rank, world_size, port, *args)
        queue.put((rank, "ok", result))
    except BaseException as e:  # noqa: BLE001 - reported to the test
        queue.put((rank, "error", (type(e).__name__, str(e), traceback.format_exc())))


def run_ranks(
    fn: Callable, world_size: int, *args: Any, timeout: float = 120.0, allow_dead: bool = False,
    port: int | None = None, group_world: int | None = None,
) -> dict[int, tuple[str, Any]]:
    """Run fn(rank, group_world or world_size, port, *args) on `world_size` processes.

    `group_world` > world_size leaves the last ranks of the group to others (e.g. engines).

    Returns {rank: ("ok", result) | ("error", (type, message, traceback)) | ("dead", exitcode)}.
    A process still running after `timeout` is killed and the test fails (a hang is a bug).
    """
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = port or free_port()
    procs = [ctx.Process(target=_child, args=(fn, r, group_world or world_size, port, args, queue))
             for r in range(world_size)]
    for p in procs:
        p.start()
    results: dict[int, tuple[str, Any]] = {}
    deadline = time.monotonic() + timeout
    while len(results) < world_size and time.monotonic() < deadline:
        try:
            rank, status, value = queue.get(timeout=0.5)
            results[rank] = (status, value)
        except Exception:  # noqa: BLE001 - queue.Empty
            if all(not p.is_alive() for p in procs) and queue.empty():
                break
    hung = [r for r, p in enumerate(procs) if p.is_alive() and r not in results]
    for p in procs:
        p.join(timeout=5)
        if p.is_alive():
            p.kill()
            p.join()
    assert not hung, f"ranks {hung} hung for more than {timeout}s"
    for r, p in enumerate(procs):
        if r not in results:
            assert allow_dead, f"rank {r} died with exit code {p.exitcode}"
            results[r] = ("dead", p.exitcode)
    return results


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
