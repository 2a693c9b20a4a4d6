"""One call to set up a refit on every training rank, one call per step.

    session = refit.connect(source, ["http://gen-0:8000"])   # every training rank
    session.refit(step)                                       # every rank, after each step

`connect` runs on every rank of the trainers' process group (torchrun, or Ray actors that set
up torch.distributed): rank 0 reaches the engines, picks the refit group's address and port and
shares them, the world size and who holds which rank, over the trainers' own store; every rank
builds the plan and the sender; rank 0 has the engines join meanwhile. Every wait is bounded by
`timeout_s`; a rank that never calls `connect`, an engine that cannot be reached, or a join that
fails raises on every rank, naming it. `refit(step)` pauses the engines, refits, commits the
step as their weight version and resumes them (rank 0 drives the engines; the other ranks
send), and returns or raises the same verdict on every rank. Training-side code: never imports
vllm.
"""

from __future__ import annotations

import itertools
import json
import os
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from common.clients.engine_client import EngineClient, PauseMode
from common.clients.fleet import EngineFleet
from common.clients.http_engine import HttpEngine
from common.config import RefitConfig
from common.errors import FormatMismatchError, RefitError
from common.plan import RefitPlan
from common.quant.fp8_plan import Fp8Source, Fp8Targets
from common.source import WeightSource
from common.stats import RefitStats
from common.transfer.sender import RefitSender
from common.wire.group import RefitGroup, free_port

_CALLS = itertools.count()  # one key space per connect() of this process
_SETUP_FAILED = "refit.connect: training rank 0 could not set up the engines"


class RefitSession:
    """What `connect` built on this rank: `refit(step)` after each training step, `close()` (or
    a `with` block) at the end. `fleet` is rank 0's (None elsewhere)."""

    def __init__(self, source: WeightSource, sender: RefitSender, group: RefitGroup,
                 fleet: EngineFleet | None, pause: PauseMode) -> None:
        self.source, self.sender, self.group = source, sender, group
        self.fleet, self.pause = fleet, pause

    def refit(self, step: int) -> RefitStats:
        """Every training rank: send this rank's weights as version `step` (rank 0 also
        pauses, commits and resumes the engines). Raises `RefitError` on every rank if any
        engine did not commit it."""
        if self.fleet is None:
            return self.sender.refit(self.source, step)
        return self.fleet.refit(lambda: self.sender.refit(self.source, step), step,
                                self.pause, group=self.group)

    def close(self) -> None:
        """Leave the refit group. The engines keep serving the last version that landed;
        clients the caller passed stay the caller's (closing a `LocalEngine` stops it)."""
        self.group.destroy()

    def __enter__(self) -> RefitSession:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def connect(source: WeightSource, engines: Sequence[str | EngineClient], *,
            config: RefitConfig | None = None, plan: RefitPlan | None = None,
            pause: PauseMode = "keep",
            process_group: Any = None, host: str | None = None,
            timeout_s: float = 120.0) -> RefitSession:
    """Set up refits from this training rank into `engines` (module docstring).

    engines: `vllm serve` URLs or engine clients (read on rank 0 only; pass the same list
        everywhere). config: bucket size, buffers, timeouts (`RefitConfig.from_env()` if None).
    plan: the plan, if this rank built it already (`RefitPlan.build(source.plan_specs(),
        config)`, the same on every rank); else built here. Engines serving a block-FP8
        checkpoint say which weights they hold in FP8: every rank then sends those quantized
        (`common.quant.fp8_plan.Fp8Source`; a passed plan must be built from its specs).
    pause: how in-flight requests fare during a refit (keep, wait, abort).
    process_group: every training rank (default: the world), rank 0 driving the engines.
    host: the address engines reach rank 0 at (default REFIT_HOST, else MASTER_ADDR, else
        127.0.0.1). The refit group's transport follows the process group's backend: NCCL
        trainers send from their GPUs, gloo trainers from the host (CUDA engines then stage
        each frame onto their GPU)."""
    if not dist.is_initialized():
        raise RefitError("refit.connect: torch.distributed is not initialized on this process "
                         "(run under torchrun, or init_process_group in each Ray actor first)")
    rank, trainers = dist.get_rank(process_group), dist.get_world_size(process_group)
    device = "cuda" if "nccl" in str(dist.get_backend(process_group)) else "cpu"
    config = plan.config if plan is not None else config or RefitConfig.from_env()
    store, key = _Shared(timeout_s), f"refit/connect/{next(_CALLS)}"
    fleet = joining = formatted = None
    if rank == 0:
        store.wait_for_ranks(key, trainers)
        try:
            fleet = EngineFleet([e if isinstance(e, EngineClient) else
                                 HttpEngine(e, timeout_s=timeout_s) for e in engines])
            fp8 = fleet.fp8_targets()
            formatted = _in_format(source, plan, config, fp8)  # refused before any join
            port, world = free_port(), fleet.world_size(trainers)
            address = host or os.environ.get("REFIT_HOST") or os.environ.get("MASTER_ADDR",
                                                                             "127.0.0.1")
            joining = fleet.join_async(address, port, trainers, timeout_s=timeout_s,
                                       transport_device=None if device == "cuda" else "cpu")
            wire = {"host": address, "port": port, "world": world,
                    "names": fleet.rank_names(trainers), "fp8": fp8 and fp8.to_json()}
        except Exception as e:
            store.set(key, {"error": f"{type(e).__name__}: {e}"})
            store.wait_for_ranks(f"{key}/read", trainers, quiet=True)  # rank 0 hosts the store
            raise RefitError(f"{_SETUP_FAILED}: {type(e).__name__}: {e}") from e
        store.set(key, wire)
    else:
        store.arrive(key, rank)
        wire = store.get(key)
        store.arrive(f"{key}/read", rank)
    if "error" in wire:
        raise RefitError(f"{_SETUP_FAILED}: {wire['error']}")
    source, plan = formatted or _in_format(
        source, plan, config, wire["fp8"] and Fp8Targets.from_json(wire["fp8"]))
    return _build(source, plan, wire, rank, trainers, device, fleet, joining, pause, timeout_s)


def _in_format(source: WeightSource, plan: RefitPlan | None, config: RefitConfig,
               fp8: Fp8Targets | None) -> tuple[WeightSource, RefitPlan]:
    """The source and plan in the engines' checkpoint format: FP8 targets quantized."""
    if fp8 is None:
        return source, plan or RefitPlan.build(source.plan_specs(), config)
    source = Fp8Source(source, fp8)
    specs = source.plan_specs()  # refuses a target the trainers cannot send, naming it
    if plan is not None and list(plan.specs) != specs:
        raise FormatMismatchError("refit.connect: the plan passed was not built for the "
                                  "engines' FP8 checkpoint; build it from Fp8Source(source, "
                                  "targets).plan_specs(), or pass none")
    return source, plan or RefitPlan.build(specs, config)


def _build(source: WeightSource, plan: RefitPlan, wire: dict, rank: int, trainers: int,
           device: str, fleet: EngineFleet | None, joining: Any, pause: PauseMode,
           timeout_s: float) -> RefitSession:
    """This rank's refit group, sender and (rank 0) the engines' join; torn down on failure."""
    names = {int(r): n for r, n in wire["names"].items()}
    group = RefitGroup(host=wire["host"], port=wire["port"], rank=rank, world_size=wire["world"],
                       num_trainers=trainers, timeout_s=timeout_s, device=device,
                       rank_names=names)
    try:
        sender = RefitSender.setup(group, plan)  # the engines' workers vet the plan too
        if joining is not None:
            joining.result(timeout_s)
    except BaseException:
        group.destroy()
        raise
    return RefitSession(source, sender, group, fleet, pause)


class _Shared:
    """connect()'s exchange over the trainers' own store (torch.distributed's default store),
    every wait bounded: rank 0 waits for every rank to arrive, the others for its answer."""

    def __init__(self, timeout_s: float) -> None:
        self.store = dist.distributed_c10d._get_default_store()
        self.timeout = timedelta(seconds=timeout_s)

    def arrive(self, key: str, rank: int) -> None:
        self.store.set(f"{key}/arrived/{rank}", "1")

    def wait_for_ranks(self, key: str, trainers: int, quiet: bool = False) -> None:
        """Until every other rank `arrive`d at `key`; `quiet`: give up silently."""
        keys = [f"{key}/arrived/{r}" for r in range(1, trainers)]
        try:
            self.store.wait(keys, self.timeout)
        except Exception as e:  # noqa: BLE001 - named below
            if quiet:
                return
            missing = [r for r, k in enumerate(keys, 1) if not self.store.check([k])]
            raise RefitError(f"refit.connect: training ranks {missing} did not call "
                             f"refit.connect within {self.timeout.total_seconds():.0f}s (every "
                             f"rank of the trainers' group must): {e}") from e

    def set(self, key: str, value: dict) -> None:
        self.store.set(key, json.dumps(value))

    def get(self, key: str) -> dict:
        """Rank 0's answer; it may first wait `timeout` for the ranks and as long again for
        the engines' answers."""
        try:
            self.store.wait([key], 2 * self.timeout)
            return json.loads(self.store.get(key))
        except Exception as e:  # noqa: BLE001 - named below
            raise RefitError(f"refit.connect: no answer from training rank 0 within "
                             f"{2 * self.timeout.total_seconds():.0f}s (does rank 0 call "
                             f"refit.connect too? did it die?): {e}") from e
