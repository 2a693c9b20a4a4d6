"""Ray placement for refit: trainer actors and engine actors from one typed layout.

`RayLayout` says how many trainer ranks and engines there are and what each bundle needs;
`RayPlacement` reserves one placement group for the trainers (one bundle per rank) and one
per engine (one bundle per worker), PACK or SPREAD as the user picks, and hands out the
scheduling options for each actor. `TrainerActor` is the base of a trainer rank in a Ray
actor: `start_trainers` starts `torch.distributed` among them (MASTER_ADDR = the rank-0
actor's node IP, a port free on that node) and their refit group follows the same rule, so
nothing assumes one host. It returns a `TrainerGroup`: calls on every rank at once, each
with a timeout, the first failure raised naming the rank, its node and pid, and whether the
actor died or raised. Imports ray and torch, never vllm or megatron.
"""

from __future__ import annotations

import dataclasses
import os
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

import ray
import torch
import torch.distributed as dist
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from common.errors import RefitError
from common.plan import RefitPlan
from common.source import WeightSource
from common.transfer.sender import RefitSender
from common.wire.addresses import bind_process_to, tcp_store
from common.wire.group import RefitGroup, free_port

STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")
_DIST_TIMEOUT_S = 300.0  # the trainers' own torch.distributed rendezvous (torch's default)


@dataclass(frozen=True)
class RayLayout:
    """Trainer ranks, engines and what each bundle reserves. Custom resources (e.g.
    {"trainer_node": 1}) pin trainers or engines to the nodes that advertise them."""

    trainers: int
    engines: int = 1
    workers_per_engine: int = 1  # TP x PP x DP of each engine
    cpus_per_trainer: float = 1.0
    gpus_per_trainer: float = 0.0
    cpus_per_worker: float = 1.0
    gpus_per_worker: float = 0.0
    strategy: str = "PACK"
    trainer_resources: dict[str, float] = field(default_factory=dict)
    engine_resources: dict[str, float] = field(default_factory=dict)
    timeout_s: float = 120.0  # placement and every actor call of the layer

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGIES:
            raise ValueError(f"RayLayout.strategy={self.strategy!r}: one of {STRATEGIES}")
        if self.trainers < 1 or self.engines < 1 or self.workers_per_engine < 1:
            raise ValueError(f"RayLayout needs >= 1 trainer, engine and worker: {self}")

    def trainer_bundle(self) -> dict[str, float]:
        return {"CPU": self.cpus_per_trainer, "GPU": self.gpus_per_trainer,
                **self.trainer_resources}

    def worker_bundle(self) -> dict[str, float]:
        return {"CPU": self.cpus_per_worker, "GPU": self.gpus_per_worker,
                **self.engine_resources}


class RayPlacement:
    """The layout's placement groups, reserved now (waits up to `layout.timeout_s`)."""

    def __init__(self, layout: RayLayout) -> None:
        self.layout = layout

        def reserve(bundle: dict[str, float], count: int, what: str) -> Any:
            bundles = [{k: v for k, v in bundle.items() if v} for _ in range(count)]
            group = placement_group(bundles, strategy=layout.strategy, name=what)
            try:
                ray.get(group.ready(), timeout=layout.timeout_s)
            except ray.exceptions.GetTimeoutError:
                remove_placement_group(group)
                raise TimeoutError(f"Ray could not place {what} ({count} x {bundles[0]}, "
                                   f"{layout.strategy}) within {layout.timeout_s:.0f}s: "
                                   f"cluster resources {ray.cluster_resources()}") from None
            return group

        self.trainer_group = reserve(layout.trainer_bundle(), layout.trainers, "refit-trainers")
        self.engine_groups = [reserve(layout.worker_bundle(), layout.workers_per_engine,
                                      f"refit-engine-{i}") for i in range(layout.engines)]

    def trainer_options(self, rank: int) -> dict[str, Any]:
        strategy = PlacementGroupSchedulingStrategy(self.trainer_group, rank)
        return {"scheduling_strategy": strategy, "num_cpus": self.layout.cpus_per_trainer,
                "num_gpus": self.layout.gpus_per_trainer}

    def engine_options(self, index: int) -> dict[str, Any]:
        """For the engine's host actor: its first worker's bundle (vLLM's own processes are
        the actor's children and stay on that node)."""
        strategy = PlacementGroupSchedulingStrategy(self.engine_groups[index], 0)
        return {"scheduling_strategy": strategy, "num_cpus": self.layout.cpus_per_worker}

    def remove(self) -> None:
        for group in [self.trainer_group, *self.engine_groups]:
            remove_placement_group(group)


class TrainerActor(ABC):
    """Base of a trainer rank in a Ray actor. A subclass builds its model in `build()` and
    returns the weight source; what else it offers is its driver's business (e.g.
    `recipes/ray_loop.py` calls `save_checkpoint(path)` and `train_step(samples)`)."""

    def __init__(self, *args: Any) -> None:
        self.args, self.sender, self.source = args, None, None
        self.session = None  # a `refit.connect` session, where a subclass made one
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
        bind_process_to(ray.util.get_node_ip_address())  # gloo: the node's address, as Ray

    def whereabouts(self) -> tuple[str, int]:
        """This actor's node IP and pid (also a liveness check)."""
        return ray.util.get_node_ip_address(), os.getpid()

    def address(self) -> tuple[str, int]:
        """This actor's node IP and a port free there (rank 0 hosts the stores)."""
        ip = ray.util.get_node_ip_address()
        return ip, free_port(ip)

    def init_distributed(self, rank: int, world: int, addr: str, port: int) -> None:
        """torch.distributed among the trainer actors; rank 0's store listens on `addr` only."""
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        store = tcp_store(addr, port, world, rank == 0, _DIST_TIMEOUT_S)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world)
        self.source = self.build()

    @abstractmethod
    def build(self) -> WeightSource:
        """After torch.distributed is up: build the model on this rank; its weight source."""

    def join_refit(self, host: str, port: int, world: int, rank_names: dict[int, str],
                   config: Any, timeout_s: float) -> str:
        """Every trainer: the refit group (the engines join it meanwhile) and the plan."""
        group = RefitGroup(host=host, port=port, rank=dist.get_rank(), world_size=world,
                           num_trainers=dist.get_world_size(), timeout_s=timeout_s,
                           rank_names=rank_names)
        plan = RefitPlan.build(self.source.plan_specs(), config)
        self.sender = RefitSender.setup(group, plan)
        return plan.digest

    def refit(self, version: int) -> dict[str, Any]:
        """Send `version` (through the session where there is one: its rank 0 also drives the
        engines); this rank's stats."""
        stats = (self.sender.refit(self.source, version) if self.session is None
                 else self.session.refit(version))
        return dataclasses.asdict(stats) | {"summary": stats.summary()}

    def shutdown(self) -> None:
        if self.sender is not None:
            self.sender.group.destroy()
        if dist.is_initialized():
            dist.destroy_process_group()


class TrainerFailure(RefitError):
    """A trainer actor died or raised during a call; the message names its rank."""


class TrainerGroup:
    """The trainer actors of one job, in rank order (see `start_trainers`)."""

    def __init__(self, actors: list[Any], timeout_s: float) -> None:
        self.actors, self.timeout_s = actors, timeout_s
        self.where = self.call("whereabouts")  # (node IP, pid) per rank

    def call(self, method: str, *args: Any, timeout_s: float | None = None) -> list[Any]:
        """`method(*args)` on every rank at once; their results in rank order."""
        futures = [getattr(a, method).remote(*args) for a in self.actors]
        return self.wait(futures, method, self.timeout_s if timeout_s is None else timeout_s)

    def wait(self, futures: list[Any], what: str, timeout_s: float) -> list[Any]:
        """Results of one future per rank; the first to fail raises at once (the others may
        be blocked on the failed rank), naming it; ranks still busy at the deadline too."""
        rank_of = {f: r for r, f in enumerate(futures)}
        pending, deadline = list(futures), time.monotonic() + timeout_s
        while pending:
            done, pending = ray.wait(pending, num_returns=1,
                                     timeout=max(0.0, deadline - time.monotonic()))
            if not done:
                late = sorted(rank_of[f] for f in pending)
                raise TrainerFailure(f"trainer rank(s) {late} did not finish {what} within "
                                     f"{timeout_s:.0f}s")
            try:
                ray.get(done[0], timeout=timeout_s)
            except ray.exceptions.RayActorError as e:
                raise TrainerFailure(f"{self._name(rank_of[done[0]])} died during {what}: "
                                     f"{_first_line(e)}") from e
            except ray.exceptions.RayTaskError as e:
                raise TrainerFailure(f"{self._name(rank_of[done[0]])} failed in {what}: "
                                     f"{type(e.cause).__name__}: {e.cause}") from e
        return ray.get(futures, timeout=timeout_s)

    def refit(self, fleet: Any, version: int, mode: str = "keep") -> list[dict[str, Any]]:
        """Refit `version` into an `EngineFleet`; every rank's stats. A rank found dead
        first leaves the engines serving (they are paused only after every rank answered)."""
        self.call("whereabouts")
        return fleet.refit(lambda: self.call("refit", version), version, mode)

    def kill(self) -> None:
        for actor in self.actors:
            ray.kill(actor, no_restart=True)

    def _name(self, rank: int) -> str:
        where = getattr(self, "where", None)
        return f"trainer rank {rank}" + (f" (pid {where[rank][1]} on {where[rank][0]})"
                                         if where else "")


def _first_line(error: BaseException) -> str:
    return next((line for line in str(error).splitlines() if line.strip()), type(error).__name__)


def start_trainers(actor_cls: type, placement: RayPlacement, *args: Any) -> TrainerGroup:
    """`layout.trainers` actors of `actor_cls` (a `TrainerActor`), one per trainer bundle,
    with `torch.distributed` up among them (each has run `build()`)."""
    layout = placement.layout
    remote = ray.remote(max_restarts=0)(actor_cls)
    actors = [remote.options(**placement.trainer_options(r)).remote(*args)
              for r in range(layout.trainers)]
    trainers = TrainerGroup(actors, layout.timeout_s)
    addr, port = ray.get(actors[0].address.remote(), timeout=layout.timeout_s)
    futures = [a.init_distributed.remote(r, layout.trainers, addr, port)
               for r, a in enumerate(actors)]
    trainers.wait(futures, "init_distributed", layout.timeout_s)
    return trainers
