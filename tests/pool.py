"""A persistent pool of spawned ranks: started once (imports cost seconds per process on 2
cores), then each job is a top-level function run on every rank at the same time."""

from __future__ import annotations

import multiprocessing as mp
import os
import queue as queue_mod
import time
import traceback
from collections.abc import Callable
from typing import Any


def _worker(rank: int, world: int, init: Callable | None, init_args: tuple, jobs: Any,
            results: Any) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    if init is not None:
        init(rank, world, *init_args)
    while True:
        job = jobs.get()
        if job is None:
            break
        fn, args = job
        try:
            results.put((rank, "ok", fn(rank, world, *args)))
        except BaseException as e:  # noqa: BLE001 - reported to the test
            results.put((rank, "error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
    if dist.is_initialized():
        dist.destroy_process_group()


class RankPool:
    """`world` spawned ranks; `init(rank, world, *init_args)` runs once in each at start."""

    def __init__(self, world: int, init: Callable | None = None, init_args: tuple = ()) -> None:
        ctx = mp.get_context("spawn")
        self.world = world
        self.results = ctx.Queue()
        self.jobs = [ctx.Queue() for _ in range(world)]
        self.procs = [ctx.Process(target=_worker, args=(r, world, init, init_args, self.jobs[r],
                                                        self.results), daemon=True)
                      for r in range(world)]
        for p in self.procs:
            p.start()
        self.broken = False

    def run(self, fn: Callable, *args: Any, timeout: float = 180.0) -> list[Any]:
        """Run fn(rank, world, *args) on every rank; returns the results by rank."""
        assert not self.broken, "an earlier job hung or crashed the pool"
        for q in self.jobs:
            q.put((fn, args))
        out: dict[int, tuple[str, Any]] = {}
        deadline = time.monotonic() + timeout
        while len(out) < self.world:
            left = deadline - time.monotonic()
            dead = [r for r, p in enumerate(self.procs) if not p.is_alive()]
            if left <= 0 or dead:
                self.broken = True
                self.close(kill=True)
                errors = {r: v for r, (s, v) in out.items() if s != "ok"}
                raise AssertionError(f"ranks hung or died (dead={dead}); errors: {errors}")
            try:
                rank, status, value = self.results.get(timeout=min(left, 1.0))
            except queue_mod.Empty:
                continue
            out[rank] = (status, value)
            if status != "ok":  # the other ranks may now wait in a collective forever
                deadline = min(deadline, time.monotonic() + 15)
        errors = {r: v for r, (s, v) in out.items() if s != "ok"}
        if errors:
            self.broken = True
            self.close(kill=True)
            raise AssertionError("\n".join(f"rank {r}: {v}" for r, v in errors.items()))
        return [out[r][1] for r in range(self.world)]

    def close(self, kill: bool = False) -> None:
        for p, q in zip(self.procs, self.jobs, strict=True):
            if p.is_alive() and not kill:
                q.put(None)
        for p in self.procs:
            p.join(timeout=0 if kill else 10)
            if p.is_alive():
                p.kill()
                p.join()
