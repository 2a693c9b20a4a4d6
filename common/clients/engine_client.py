"""Training-side control of vLLM engines that run the `refit` backend; never imports vllm.

One interface (`EngineClient`) over three hosts: a `vllm serve` server
(`common.clients.http_engine`), an engine in a child process of the trainer
(`common.clients.local_engine`), an engine in a Ray actor (`common.clients.ray_engine`). A
refit of one engine, from training rank 0:

    engine.pause("keep")                  # vLLM does not guard an update: always pause first
    refitting = engine.refit_async(step)  # the engine receives while the trainers broadcast
    sender.refit(source, step)            # every training rank
    refitting.result()
    engine.finish(step)                   # the engine now reports weight version str(step)
    engine.resume()

`common.clients.fleet.EngineFleet` does the same for several engines (DP replicas, several
servers) in one refit group, and carries the refit's verdict to every trainer. A failed refit
that every worker rolled back (`RefitConfig.undo_bytes`) leaves the engine serving its last
complete version (it resumes by itself unless told to stay paused). After any other failed
refit the engine stays paused: `resume()` and `generate()` refuse and `finish()` raises,
naming the failed and the last complete version, until a refit lands; the version the engine
reports stays the last complete one. A version not newer than the engine's is refused.

The engine itself keeps that state (`common.engine.state`), so it holds after its trainer
died: its server refuses to serve and to resume mixed weights, and a client that joins later
adopts the state (`join_async`): the version, a failure, a refit that landed unfinished.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

from common.engine.state import RefitState
from common.errors import NOTHING_LOADED, ROLLED_BACK, RefitError
from common.quant.fp8_plan import Fp8Targets

log = logging.getLogger(__name__)
PauseMode = Literal["abort", "wait", "keep"]
PAUSE_MODES = ("abort", "wait", "keep")
T = TypeVar("T")


class EngineError(RefitError):
    """A call to an engine failed; the message names the engine, the step and the cause."""


@dataclass(frozen=True)
class JoinInfo:
    """The refit backend's init info for one engine (`common.in_vllm.backend.RefitInitInfo`)."""

    host: str
    port: int
    world_size: int
    num_trainers: int
    rank_offset: int
    timeout_s: float = 300.0
    group_name: str = "refit"
    transport_device: str | None = None  # None: each worker's own device; "cpu": host staging

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class Completion:
    """One greedy (or sampled) completion; `weight_versions` = (version, start, end) spans over
    the output tokens, as vLLM reports them: which weights produced which tokens."""

    tokens: list[int]
    logprobs: list[float]
    finish_reason: str
    weight_versions: list[tuple[str, int, int]]


class EngineClient(ABC):
    """One vLLM engine (every worker of it) as seen from training rank 0 (module docstring).

    Subclasses implement the transport (`_` methods); this class keeps the refit state rules.
    `timeout_s` bounds every control call; joins and refits use the join's timeout.
    """

    def __init__(self, name: str, timeout_s: float = 60.0) -> None:
        self.name, self.timeout_s = name, timeout_s
        self.version: int | None = None  # last complete version, learnt at join
        self.failed: tuple[int, str] | None = None  # (version, why) until a refit lands
        self.paused = False  # by this client
        self.state: RefitState | None = None  # the engine's own, as read at the last join
        self._refit: tuple[int, Future, float] | None = None  # version, call, timeout
        self._join_timeout_s = 300.0
        self._workers: int | None = None
        self._closed = False

    # --- transport, one per host -----------------------------------------------------------
    @abstractmethod
    def _num_workers(self) -> int: ...
    @abstractmethod
    def _pause(self, mode: PauseMode, clear_cache: bool) -> None: ...
    @abstractmethod
    def _resume(self) -> None: ...
    @abstractmethod
    def _init(self, info: dict[str, Any], timeout_s: float) -> None: ...
    @abstractmethod
    def _start(self) -> None: ...
    @abstractmethod
    def _update(self, info: dict[str, Any], timeout_s: float) -> None: ...
    @abstractmethod
    def _finish(self, version: str) -> None: ...
    @abstractmethod
    def _get_version(self) -> str: ...
    @abstractmethod
    def _state(self) -> RefitState: ...
    @abstractmethod
    def _is_paused(self) -> bool: ...
    @abstractmethod
    def _set_version(self, version: str) -> None: ...
    @abstractmethod
    def _fp8_targets(self) -> dict[str, Any] | None: ...

    @abstractmethod
    def _generate(self, prompts: list[list[int]], max_tokens: int,
                  **sampling: Any) -> list[Completion]: ...

    def generate(self, prompts: list[list[int]], max_tokens: int,
                 **sampling: Any) -> list[Completion]:
        """Completions of token-id prompts (greedy unless `sampling` says otherwise); refused
        after a failed refit (the engine holds a mix of versions) until a refit lands."""
        self._refuse_if_failed("serve")
        return self._generate(prompts, max_tokens, **sampling)

    def _refuse_if_failed(self, what: str) -> None:
        if self.failed is not None:
            version, why = self.failed
            raise EngineError(f"engine {self.name}: refusing to {what}: refit v{version} "
                              f"failed ({why}); it holds a mix of versions (last complete "
                              f"v{self.version}); a refit must land first")

    def close(self) -> None:
        """No more background calls; one still outstanding ends by its own timeout."""
        self._closed = True

    # --- the refit protocol ----------------------------------------------------------------
    def _do(self, what: str, fn: Callable[[], T]) -> T:
        try:
            return fn()
        except EngineError:
            raise
        except Exception as e:  # noqa: BLE001 - rewrapped with the engine and the step
            raise EngineError(f"engine {self.name}: {what} failed: {type(e).__name__}: "
                              f"{e}") from e

    def num_workers(self) -> int:
        """Workers of this engine (TP x PP x DP): each is one rank of the refit group."""
        if self._workers is None:
            self._workers = self._do("asking its world size", self._num_workers)
        return self._workers

    def weight_version(self) -> str:
        return self._do("reading its weight version", self._get_version)

    def is_paused(self) -> bool:
        return self._do("reading whether it is paused", self._is_paused)

    def fp8_targets(self) -> Fp8Targets | None:
        """The weights this engine's checkpoint holds in block FP8 (the trainers quantize
        them before sending), None when it serves an unquantized checkpoint."""
        found = self._do("reading its checkpoint's FP8 weights", self._fp8_targets)
        return None if found is None else Fp8Targets.from_json(found)

    def engine_state(self) -> RefitState:
        """The engine's own refit state, read from its workers now (`common.engine.state`)."""
        return self._do("reading its refit state", self._state)

    def pause(self, mode: PauseMode = "keep", clear_cache: bool = True) -> None:
        """abort: in-flight requests end (finish reason abort); wait: they finish under the
        old weights first; keep: they freeze and continue after `resume` (re-prefilled under
        the new weights when `clear_cache`). New requests queue until `resume`."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause mode {mode!r} is not one of {PAUSE_MODES}")
        self._do(f"pause (mode {mode})", lambda: self._pause(mode, clear_cache))
        self.paused = True

    def resume(self) -> None:
        self._refuse_if_failed("resume")
        self._do("resume", self._resume)
        self.paused = False

    def join_async(self, info: JoinInfo) -> Future:
        """Join the refit group (every worker, ranks from `info.rank_offset`); returns at once,
        the trainers run `RefitSender.setup` meanwhile. The engine's version is learnt here
        (an engine still at vLLM's "default" is set to "0", its starting checkpoint)."""
        def join() -> None:
            current = self._get_version()
            if current == "default":
                self._set_version("0")
                current = "0"
            self._adopt(self._state(), int(current) if current.isdigit() else None)
            self._init(info.as_dict(), info.timeout_s)

        self._join_timeout_s = info.timeout_s
        return self._submit(f"joining refit group {info.group_name!r} at {info.host}:"
                            f"{info.port} as ranks {info.rank_offset}..", join)

    def _adopt(self, state: RefitState, labelled: int | None) -> None:
        """Take over the engine's refit state at join: commit a refit that landed on every
        worker but was never finished (its trainer died before `finish`), end a refit that was
        started but never sent (vLLM would refuse the next start), then adopt the version
        and a failure with mixed weights."""
        if state.phase == "landed":
            log.warning("engine %s: refit v%s landed on every worker but was not finished; "
                        "committing it", self.name, state.landed)
            self._finish(str(state.landed))
            state = self._state()
        elif state.phase == "refitting" and not state.receiving:
            log.warning("engine %s: a refit was started but never sent; ending it", self.name)
            try:
                self._update({"version": -1, "abandon": True}, self.timeout_s)
            except Exception:  # noqa: BLE001 - it raises by design: vLLM then ends the update
                pass
            state = self._state()
        self.state = state
        self.version = labelled if state.version is None else state.version
        self.failed = (state.failed, state.why) if state.phase == "mixed" else None
        if state.phase != "complete" or state.failed is not None:
            log.warning("engine %s: joins %s (last complete v%s, last failed refit v%s: %s)",
                        self.name, state.phase, self.version, state.failed, state.why)

    def check_refit(self, version: int) -> None:
        """Raise unless refit `version` can start now (none pending, newer than the engine's)."""
        if self._refit is not None:
            raise EngineError(f"engine {self.name}: refit v{self._refit[0]} is still pending")
        if self.version is not None and version <= self.version:
            raise EngineError(f"engine {self.name}: refit v{version} refused: not newer than "
                              f"v{self.version}, the version it holds")

    def check_verify(self, version: int) -> None:
        """Raise unless a verification of `version` can start now (none pending, and it is
        the version the engine holds)."""
        if self._refit is not None:
            raise EngineError(f"engine {self.name}: refit v{self._refit[0]} is still pending")
        if version != self.version:
            raise EngineError(f"engine {self.name}: verify v{version} refused: the engine "
                              f"holds v{self.version}")

    def refit_async(self, version: int, verify: bool = False,
                    timeout_s: float | None = None) -> Future:
        """Start receiving refit `version` (call `pause` first); returns at once. `verify`:
        the trainers resend the version the engine holds; each worker applies it and fails
        the refit if a param it can read changed (it did not hold those bytes). `timeout_s`
        (the refit's own timeout, `RefitConfig.timeout_s`; default: the join's) bounds the
        engine's answer, and `finish`'s wait for it once the trainers have sent."""
        if verify:
            self.check_verify(version)
        else:
            self.check_refit(version)
        what = f"{'verify' if verify else 'refit'} v{version}"
        if not self.paused:
            raise EngineError(f"engine {self.name}: {what} refused: pause the engine first "
                              f"(vLLM does not guard a weight update against requests)")

        timeout_s = self._join_timeout_s if timeout_s is None else timeout_s

        def refit() -> None:
            self._start()
            self._update({"version": version, "verify": verify}, timeout_s)

        future = self._submit(what, refit)
        self._refit = (version, future, timeout_s)
        return future

    def finish(self, version: int) -> None:
        """Wait for refit `version` and commit it as the engine's weight version."""
        if self._refit is None or self._refit[0] != version:
            raise EngineError(f"engine {self.name}: finish v{version} without refit_async"
                              f"({version})")
        _, future, timeout_s = self._refit
        self._refit = None
        try:
            _result_within(future, timeout_s, f"engine {self.name}: no answer to refit "
                                              f"v{version}")
        except Exception as e:  # noqa: BLE001 - recorded, then raised with both versions
            if NOTHING_LOADED in str(e):  # every worker says so: the old weights are intact
                raise EngineError(f"engine {self.name}: refit v{version} failed before any "
                                  f"weight was loaded; it still serves v{self.version}: "
                                  f"{e}") from e
            if ROLLED_BACK in str(e):  # its workers agreed they restored the old weights
                self.paused = self.is_paused()
                raise EngineError(f"engine {self.name}: refit v{version} failed and was "
                                  f"rolled back; it serves v{self.version}: {e}") from e
            self.failed = (version, str(e))
            raise EngineError(f"engine {self.name}: refit v{version} failed; the engine stays "
                              f"paused and reports v{self.version}, the last complete version: "
                              f"{e}") from e
        try:
            self._do(f"finish v{version}", lambda: self._finish(str(version)))
        except EngineError as e:  # the bytes are in, the version is not: not servable
            self.failed = (version, str(e))
            raise
        self.version, self.failed = version, None

    def _submit(self, what: str, fn: Callable[[], None]) -> Future:
        """`fn` on a daemon thread of its own: a trainer that fails while a join or a refit is
        outstanding exits at once (a pool's threads would hold the process until the call's
        own timeout)."""
        if self._closed:
            raise EngineError(f"engine {self.name}: {what} refused: the client is closed")
        future: Future = Future()

        def run() -> None:
            if not future.set_running_or_notify_cancel():
                return
            try:
                future.set_result(self._do(what, fn))
            except BaseException as e:  # noqa: BLE001 - the caller's future raises it
                future.set_exception(e)

        threading.Thread(target=run, name=f"engine {self.name}: {what}", daemon=True).start()
        return future

    def __enter__(self) -> EngineClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _result_within(future: Future, timeout_s: float, what: str) -> Any:
    """`future.result()` within `timeout_s`, or a `TimeoutError` that says what and how long."""
    try:
        return future.result(timeout_s)
    except FutureTimeout:
        raise TimeoutError(f"{what} within {timeout_s:.0f}s (the refit's timeout)") from None
