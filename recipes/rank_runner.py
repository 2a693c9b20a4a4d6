"""Run a function on several new processes, each a rank: once (`run_ranks`, a fresh set of
processes per call) or as a persistent pool (`RankPool`: imports paid once, then one job after
another). The tests and the benchmarks use these two and nothing else to start ranks. Ranks
fork from a server that imported torch once (`recipes.rank_forkserver`) and run in the
environment this process had when it started them.

A rank's outcome is ("ok", result), ("error", (type name, message, traceback)) or
("dead", exit code); a rank still running past the timeout is a hang and fails the caller.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue as queue_mod
import time
import traceback
from collections.abc import Callable
from typing import Any

from common.wire.group import free_port
from recipes.rank_forkserver import rank_context

Outcome = tuple[str, Any]


def _enter(env: dict[str, str], threads: int | None) -> None:
    """A new rank's first step: its starter's environment (the server's may be older), then
    one thread per rank by default: several ranks (and engines) share 2 cores."""
    os.environ.clear()
    os.environ.update(env)
    if threads is None:
        return
    os.environ["OMP_NUM_THREADS"] = str(threads)
    import torch

    torch.set_num_threads(threads)


def _outcome(fn: Callable, args: tuple) -> Outcome:
    try:
        return "ok", fn(*args)
    except BaseException as e:  # noqa: BLE001 - reported to the caller
        return "error", (type(e).__name__, str(e), traceback.format_exc())


def _collect(results: Any, procs: list, deadline: float, out: dict[int, Outcome], *,
             grace_s: float | None = None, stop_on_death: bool = False) -> None:
    """Read outcomes into `out` until every rank has one, the deadline passes or no process is
    left to send one (`stop_on_death`: any rank that died without one). `grace_s`: after an
    error the others get this long (they may be stuck in a collective with the failed rank)."""
    while len(out) < len(procs):
        left = deadline - time.monotonic()
        if left <= 0:
            return
        try:
            rank, status, value = results.get(timeout=min(left, 0.5))
        except queue_mod.Empty:
            dead = [r for r, p in enumerate(procs) if not p.is_alive() and r not in out]
            if results.empty() and (len(dead) == len(procs) - len(out)
                                    or (dead and stop_on_death)):
                return
            continue
        out[rank] = (status, value)
        if status != "ok" and grace_s is not None:
            deadline = min(deadline, time.monotonic() + grace_s)


def _stop(procs: list, wait_s: float) -> None:
    for p in procs:
        p.join(timeout=wait_s)
        if p.is_alive():
            p.kill()
            p.join()


def _one_shot(fn: Callable, rank: int, world: int, port: int, args: tuple, results: Any,
              threads: int | None, env: dict[str, str]) -> None:
    _enter(env, threads)
    results.put((rank, *_outcome(fn, (rank, world, port, *args))))


def run_ranks(fn: Callable, world_size: int, *args: Any, timeout: float = 120.0,
              allow_dead: bool = False, port: int | None = None,
              group_world: int | None = None, threads: int | None = 1,
              fresh_interpreters: bool = False) -> dict[int, Outcome]:
    """Run fn(rank, group_world or world_size, port, *args) on `world_size` new processes.

    `group_world` > world_size leaves the last ranks of the group to others (e.g. engines).
    Returns each rank's outcome; a rank with none died ("dead", exit code; fails unless
    `allow_dead`). A process still running after `timeout` is killed and the call fails.
    `fresh_interpreters`: spawn each rank instead (its imports and allocator its own: what a
    measure of a rank's resident memory needs).
    """
    ctx = mp.get_context("spawn") if fresh_interpreters else rank_context()
    results = ctx.Queue()
    port = port or free_port()
    procs = [ctx.Process(target=_one_shot, args=(fn, r, group_world or world_size, port, args,
                                                 results, threads, dict(os.environ)))
             for r in range(world_size)]
    for p in procs:
        p.start()
    out: dict[int, Outcome] = {}
    _collect(results, procs, time.monotonic() + timeout, out)
    hung = [r for r, p in enumerate(procs) if p.is_alive() and r not in out]
    _stop(procs, 5)
    assert not hung, f"ranks {hung} hung for more than {timeout}s"
    for r, p in enumerate(procs):
        if r not in out:
            assert allow_dead, f"rank {r} died with exit code {p.exitcode}"
            out[r] = ("dead", p.exitcode)
    return out


def _pool_worker(rank: int, world: int, init: Callable | None, init_args: tuple, jobs: Any,
                 results: Any, env: dict[str, str]) -> None:
    _enter(env, 1)
    import torch.distributed as dist

    if init is not None:
        init(rank, world, *init_args)
    while (job := jobs.get()) is not None:
        fn, args = job
        results.put((rank, *_outcome(fn, (rank, world, *args))))
    if dist.is_initialized():
        dist.destroy_process_group()


class RankPool:
    """`world` ranks (forked, as `run_ranks`'); `init(rank, world, *init_args)` runs once in each
    at start."""

    def __init__(self, world: int, init: Callable | None = None, init_args: tuple = ()) -> None:
        ctx = rank_context()
        self.world = world
        self.results = ctx.Queue()
        self.jobs = [ctx.Queue() for _ in range(world)]
        self.procs = [ctx.Process(target=_pool_worker, daemon=True,
                                  args=(r, world, init, init_args, self.jobs[r], self.results,
                                            dict(os.environ)))
                      for r in range(world)]
        for p in self.procs:
            p.start()
        self.broken = False

    def run(self, fn: Callable, *args: Any, timeout: float = 180.0) -> list[Any]:
        """Run fn(rank, world, *args) on every rank; returns the results by rank. A rank that
        fails, dies or hangs fails the call and the pool (its ranks may be mid-collective)."""
        assert not self.broken, "an earlier job hung or crashed the pool"
        for q in self.jobs:
            q.put((fn, args))
        out: dict[int, Outcome] = {}
        _collect(self.results, self.procs, time.monotonic() + timeout, out, grace_s=15.0,
                 stop_on_death=True)
        errors = {r: v[2] for r, (s, v) in out.items() if s != "ok"}
        if errors or len(out) < self.world:
            self.broken = True
            dead = [r for r, p in enumerate(self.procs) if not p.is_alive()]
            self.close(kill=True)
            missing = sorted(set(range(self.world)) - set(out))
            raise AssertionError("\n".join(f"rank {r}: {v}" for r, v in errors.items())
                                 + (f"\nranks {missing} hung or died (dead: {dead})"
                                    if missing else ""))
        return [out[r][1] for r in range(self.world)]

    def close(self, kill: bool = False) -> None:
        if not kill:
            for p, q in zip(self.procs, self.jobs, strict=True):
                if p.is_alive():
                    q.put(None)
        _stop(self.procs, 0 if kill else 10)
