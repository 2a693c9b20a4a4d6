"""`EngineFleet`: several engines (DP replicas, several servers) paused, refit, committed and
resumed together in one refit group, from training rank 0; the refit's verdict reaches every
trainer through the group (`EngineFleet.refit(..., group=)`). Training side: never imports
vllm."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, TypeVar

from common.clients.engine_client import EngineClient, EngineError, JoinInfo, PauseMode
from common.errors import FormatMismatchError, RefitError
from common.quant.fp8_plan import Fp8Targets

if TYPE_CHECKING:
    from common.wire.transport import Transport

log = logging.getLogger(__name__)
T = TypeVar("T")


class EngineFleet:
    """Several engines in one refit group, paused, refit and resumed together (module doc).

    Trainers are refit ranks 0..T-1; engine i's workers follow in order.
    """

    def __init__(self, engines: Sequence[EngineClient]) -> None:
        self.engines = list(engines)

    def world_size(self, num_trainers: int) -> int:
        return num_trainers + sum(e.num_workers() for e in self.engines)

    def rank_names(self, num_trainers: int) -> dict[int, str]:
        """{refit rank: "engine NAME"} for every engine worker: pass it to every trainer's
        `RefitGroup(rank_names=...)` so a failure names the engine behind a rank."""
        names, rank = {}, num_trainers
        for engine in self.engines:
            for _ in range(engine.num_workers()):
                names[rank] = f"engine {engine.name}"
                rank += 1
        return names

    def fp8_targets(self) -> Fp8Targets | None:
        """What every engine's checkpoint holds in block FP8 (`EngineClient.fp8_targets`):
        one plan feeds them all, so engines that disagree are refused, naming them."""
        found = {e.name: e.fp8_targets() for e in self.engines}
        kinds = {t: [n for n, u in found.items() if u == t] for t in found.values()}
        if len(kinds) > 1:
            says = "; ".join(f"{', '.join(names)}: "
                             f"{'unquantized' if t is None else f'{len(t.names)} FP8 weights'}"
                             for t, names in kinds.items())
            raise FormatMismatchError(f"the engines serve checkpoints of different formats "
                                      f"({says}); one refit group feeds one format")
        return next(iter(kinds), None)

    def join_async(self, host: str, port: int, num_trainers: int, timeout_s: float = 300.0,
                   group_name: str = "refit", transport_device: str | None = None,
                   ) -> FleetFuture:
        """Every engine joins (its workers as the ranks after the previous engine's);
        `transport_device` "cpu": CUDA engines join the trainers' group over gloo on the host
        (host staging: each frame is copied to the GPU, then applied)."""
        world, offset, futures = self.world_size(num_trainers), num_trainers, []
        for engine in self.engines:
            info = JoinInfo(host, port, world, num_trainers, offset, timeout_s, group_name,
                            transport_device)
            futures.append(engine.join_async(info))
            offset += engine.num_workers()
        return FleetFuture(futures)

    def pause(self, mode: PauseMode = "keep", clear_cache: bool = True) -> None:
        _all(self.engines, lambda e: e.pause(mode, clear_cache))

    def resume(self) -> None:
        _all(self.engines, EngineClient.resume)

    def finish(self, version: int) -> None:
        _all(self.engines, lambda e: e.finish(version))

    def refit(self, send: Callable[[], T], version: int, mode: PauseMode = "keep",
              verify: bool = False, group: Transport | None = None) -> T:
        """Pause, receive while `send()` broadcasts (the sender's refit on training rank 0),
        finish and resume every engine; returns what `send` returned. A failure raises; an
        engine it left intact (no worker loaded a byte) is resumed and serves its last
        version, the others stay paused and refuse to serve until a refit lands. `verify`:
        `version` is the one the engines hold, resent to check it (`refit_async`).

        `group`: rank 0's refit group (pass it whenever this runs on training rank 0). The
        refit's verdict then reaches every trainer: the other trainers' `sender.refit`
        returns only once every engine committed the version, and raises if one did not; a
        failure here before or during the send writes the group's abort record (every
        trainer raises within a second; rebuild the group), one after it the verdict. The
        engines' calls are bounded by the group's refit timeout. Without `group` (a driver
        outside the group, e.g. Ray's `TrainerGroup`) the verdict is this call alone."""
        if group is not None and group.rank != 0:
            raise ValueError(f"EngineFleet.refit runs on refit rank 0, not {group.label}")
        t0, phase = time.perf_counter(), "before"
        if group is not None:
            group.verdict_by_caller = True
        try:
            check = EngineClient.check_verify if verify else EngineClient.check_refit
            _all(self.engines, lambda e: check(e, version))  # before any engine pauses
            self.pause(mode)
            for engine in self.engines:
                engine.refit_async(version, verify, group.timeout_s if group else None)
            phase = "during"
            result = self._send(send, version)
            phase = "after"
            self._commit(version)
        except BaseException as e:
            if group is not None:
                _tell_trainers(group, version, e, phase)
            raise
        finally:
            if group is not None:
                group.verdict_by_caller = False
        if group is not None:
            group.publish_verdict(None)
        log.info("refit v%d into %d engine(s): %.1f ms paused (mode %s)", version,
                 len(self.engines), (time.perf_counter() - t0) * 1e3, mode)
        return result

    def _send(self, send: Callable[[], T], version: int) -> T:
        """`send()`; if it fails, each engine's refit is waited for (recording its failure)
        and the engines it left intact are resumed."""
        try:
            return send()
        except BaseException:
            with contextlib.suppress(EngineError):  # records each engine's failure
                self.finish(version)
            self._resume_intact()
            raise

    def _commit(self, version: int) -> None:
        """Finish (commit `version`) and resume every engine, after the bytes arrived."""
        try:
            self.finish(version)
        except EngineError:
            self._resume_intact()
            raise
        self.resume()

    def _resume_intact(self) -> None:
        """After a failed refit: resume the engines it left intact (nothing loaded)."""
        for engine in self.engines:
            if engine.failed is None and engine.paused:
                with contextlib.suppress(EngineError):
                    engine.resume()

    def close(self) -> None:
        for engine in self.engines:
            engine.close()


class FleetFuture:
    """Calls in flight on several engines: `result()` waits for all, then raises the first
    failure (each engine's error names the engine)."""

    def __init__(self, futures: list[Future]) -> None:
        self.futures = futures

    def result(self, timeout_s: float | None = 600.0) -> list[Any]:
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        out, errors = [], []
        for future in self.futures:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                out.append(future.result(left))
            except Exception as e:  # noqa: BLE001 - every engine is waited for first
                errors.append(e)
        if errors:
            raise errors[0]
        return out


def _tell_trainers(group: Transport, version: int, error: BaseException, phase: str) -> None:
    """Rank 0's failure outside the collectives, to the other trainers: after the send, the
    verdict (they wait for it); before it, or from the send but not from the refit protocol
    (which told every rank itself: its status exchange or abort record), the abort record
    (they wait in a collective)."""
    if phase == "during" and isinstance(error, RefitError):
        return
    why = f"EngineFleet.refit v{version} failed {phase} the send: {type(error).__name__}: {error}"
    with contextlib.suppress(Exception):  # a dead store: the others notice it themselves
        if phase == "after":
            group.publish_verdict(why)
        else:
            group.post_abort(why)


def _all(engines: Sequence[EngineClient], call: Callable[[EngineClient], None]) -> None:
    """`call` on every engine, even after one fails; then raise: the failure, or one error
    naming every failed engine's (each message names its engine)."""
    errors = []
    for engine in engines:
        try:
            call(engine)
        except Exception as e:  # noqa: BLE001 - the others still get the call
            errors.append(e)
    if len(errors) == 1:
        raise errors[0]
    if errors:
        raise EngineError(f"{len(errors)} of {len(engines)} engines failed: "
                          + " | ".join(str(e) for e in errors)) from errors[0]
