"""A trainer process of the `-k survives` tests, following docs/failures.md's crash-restart path:
a new group on a fresh port, the engine joined again, its state adopted; then refits that
land, then (optionally) one it dies in with SIGKILL at a chosen point.

Also the test's worker extension: refit's own plus a one-shot loader fault on one worker
(how a framework adds its own methods: it inherits `RefitWorkerExtension`).
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import torch

from common.clients.fleet import EngineFleet
from common.clients.http_engine import HttpEngine
from common.config import RefitConfig
from common.in_vllm.worker_ext import RefitWorkerExtension
from common.plan import RefitPlan
from common.source import DictWeightSource
from common.transfer.sender import RefitSender
from common.wire.group import RefitGroup
from tests.serve.conftest import PROMPTS, SHORT, TIMEOUT_S

REFIT_TIMEOUT_S = 30.0
FAULTY_EXTENSION = "tests.serve.survive_trainer.FaultyLoaderExtension"


def weights(states: list[dict[str, torch.Tensor]], version: int) -> dict[str, torch.Tensor]:
    """Even versions: the starting checkpoint's weights; odd: the changed ones."""
    return states[version % 2]


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


class _DyingSource(DictWeightSource):
    """Dies with SIGKILL when the sender asks for tensor `at` (0: before the first bucket)."""

    def __init__(self, tensors: dict, at: int) -> None:
        super().__init__(tensors)
        self.at = at

    def iter_tensors(self, plan):
        for i, item in enumerate(super().iter_tensors(plan)):
            if i == self.at:
                _die()
            yield item


def _dying_refit(sender: RefitSender, state: dict, version: int, point: str) -> None:
    """before_first_bucket, mid_way; before_commit: every bucket sent, death before the
    status exchange; before_finish: the refit landed on every rank, death before `finish`."""
    if point == "before_commit":
        sender.finish = lambda *args: _die()
    if point in ("before_commit", "before_finish"):
        source = DictWeightSource(state)
    else:
        source = _DyingSource(state, 0 if point == "before_first_bucket" else len(state) // 2)
    sender.refit(source, version)
    _die()


def trainer_cycle(rank: int, world: int, port: int, url: str, states: list, undo: bool,
                  landed: list[int], die: tuple[int, str] | None, out: str,
                  transport_device: str | None = None) -> None:
    """Join the engine at `url`, write what it adopted to `out`, refit every version of
    `landed` (writing the greedy outputs after the last), then refit `die` = (version, point)
    and die in it. A mixed engine's refusals of `resume` / `generate` are recorded first.
    `transport_device` "cpu": a CUDA server's workers receive over gloo (host staging)."""
    engine = HttpEngine(url, timeout_s=TIMEOUT_S)
    fleet = EngineFleet([engine])
    joining = fleet.join_async("127.0.0.1", port, 1, timeout_s=TIMEOUT_S,
                               transport_device=transport_device)
    group = RefitGroup(host="127.0.0.1", port=port, rank=rank, world_size=world,
                       num_trainers=1, timeout_s=TIMEOUT_S, device="cpu",
                       rank_names=fleet.rank_names(1))
    config = RefitConfig(bucket_bytes=16 << 10, timeout_s=REFIT_TIMEOUT_S,
                         undo_bytes=(1 << 30) if undo else 0)
    plan = RefitPlan.build(DictWeightSource(states[0]).plan_specs(), config)
    sender = RefitSender.setup(group, plan)
    joining.result(TIMEOUT_S)
    record: dict = {"adopted": {"version": engine.version, "failed": engine.failed,
                                "state": engine.state.as_dict()}, "refused": {}}
    if engine.failed is not None:
        # the server's own answers (the client's transport, past its own refusal)
        for what, call in (("resume", engine._resume),
                           ("generate", lambda: engine._generate(PROMPTS, 1))):
            try:
                call()
                record["refused"][what] = None
            except Exception as e:  # noqa: BLE001 - the engine's own refusal, checked by the test
                record["refused"][what] = str(e)
    for version in landed:
        fleet.refit(lambda v=version: sender.refit(DictWeightSource(weights(states, v)), v),
                    version, "keep", group=group)
    outs = engine.generate(PROMPTS, SHORT)
    record["outputs"] = [[o.tokens, o.logprobs] for o in outs]
    record["version"] = engine.weight_version()
    Path(out).write_text(json.dumps(record))
    if die is not None:
        version, point = die
        fleet.refit(lambda: _dying_refit(sender, weights(states, version), version, point),
                    version, "keep", group=group)
    group.destroy()


class FaultyLoaderExtension(RefitWorkerExtension):
    """Refit's worker extension plus `arm_loader_fault`: every load of the next `refits`
    refits (a rollback counts as one) fails on the worker of that rank."""

    def arm_loader_fault(self, rank: str, refits: str = "1") -> None:
        if int(rank) != self.rank:
            return
        engine = self.weight_transfer_engine
        real, left = engine._loaders, [int(refits)]

        def loaders(*args, **kwargs):
            left[0] -= 1
            if left[0] == 0:
                engine._loaders = real

            def fail(*_args, **_kwargs):
                raise RuntimeError(f"injected loader fault on worker {self.rank}")

            return fail, fail

        engine._loaders = loaders
