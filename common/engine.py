"""Run a vLLM engine in its own process and drive it from a training rank.

`EngineProcess` starts `LLM(...)` in a child process with a clean environment (no torchrun
RANK / MASTER_* leaking into vLLM), the refit worker extension loaded, and serves one command
at a time over a pipe. Commands are plain data; weights travel only over the refit group.
`submit` returns at once, so the training rank can broadcast while the engine receives.
Generation and refits are serialised in the engine process, so generation is paused while
weights are mixed; after a failed refit the engine refuses to generate until one lands.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time
from dataclasses import dataclass, field
from typing import Any

from common.errors import RefitError

# Variables of the training launcher that must not reach vLLM (it would join the wrong group).
_LAUNCHER_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                  "ROLE_RANK", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                  "GROUP_WORLD_SIZE", "ROLE_NAME", "TORCHELASTIC_RUN_ID")


class EngineError(RefitError):
    """A command failed inside the engine process (its type, message and traceback inside)."""


@dataclass(frozen=True)
class EngineConfig:
    """How to start one engine. `llm_kwargs` go to `vllm.LLM` as they are."""

    model: str
    dtype: str = "bfloat16"
    threads: int = 1
    in_process_worker: bool = True  # VLLM_ENABLE_V1_MULTIPROCESSING=0: fast start, deterministic
    disable_cpu_amx: bool = True  # see vllm_worker.serve
    start_timeout_s: float = 300.0
    llm_kwargs: dict[str, Any] = field(default_factory=dict)


class Pending:
    """A command in flight; `result()` waits for the engine's answer."""

    def __init__(self, engine: EngineProcess, command: str) -> None:
        self.engine, self.command = engine, command

    def result(self, timeout_s: float = 600.0) -> Any:
        return self.engine._answer(self.command, timeout_s)


class EngineProcess:
    """One vLLM engine in a child process (see the module docstring)."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        env = {k: os.environ.pop(k) for k in _LAUNCHER_VARS if k in os.environ}
        try:
            from common.vllm_worker import serve  # noqa: PLC0415 - child-side entry point

            self._proc = ctx.Process(target=serve, args=(child, config), daemon=True)
            self._proc.start()
        finally:
            os.environ.update(env)
        self._busy: str | None = "start"
        Pending(self, "start").result(config.start_timeout_s)

    def submit(self, command: str, *args: Any) -> Pending:
        if self._busy is not None:
            raise RuntimeError(f"engine is still busy with {self._busy!r}")
        self._conn.send((command, args))
        self._busy = command
        return Pending(self, command)

    def call(self, command: str, *args: Any, timeout_s: float = 600.0) -> Any:
        return self.submit(command, *args).result(timeout_s)

    def _answer(self, command: str, timeout_s: float) -> Any:
        deadline = time.monotonic() + timeout_s
        while not self._conn.poll(0.1):
            if not self._proc.is_alive():
                self._busy = None
                raise EngineError(f"engine process died (exit code {self._proc.exitcode}) "
                                  f"during {command!r}")
            if time.monotonic() > deadline:
                raise EngineError(f"engine gave no answer to {command!r} in {timeout_s:.0f}s")
        status, value = self._conn.recv()
        self._busy = None
        if status == "ok":
            return value
        kind, message, trace = value
        raise EngineError(f"engine {command!r} failed: {kind}: {message}\n{trace}")

    def kill(self) -> None:
        """Kill the engine process at once (tests of a peer dying mid-refit)."""
        self._proc.kill()
        self._proc.join()

    def close(self) -> None:
        if self._proc.is_alive():
            if self._busy is None:
                self._conn.send(("stop", ()))
            self._proc.join(timeout=30)
            if self._proc.is_alive():
                self._proc.kill()
                self._proc.join()

    def __enter__(self) -> EngineProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class EngineFleet:
    """The engines of one refit group, driven from training rank 0 (they are ranks T..T+I-1).

        fleet = EngineFleet([EngineProcess(EngineConfig(model=ckpt)) for _ in range(2)])
        joining = fleet.join_async(host, port, num_trainers=T)   # then, on every trainer:
        sender = RefitSender.setup(group, plan)                   # ... the handshake
        joining.result()
        refitting = fleet.refit_async(); sender.refit(source, step); refitting.result()
    """

    def __init__(self, engines: list[EngineProcess]) -> None:
        self.engines = engines

    def join_async(self, host: str, port: int, num_trainers: int, timeout_s: float = 300.0,
                   name: str = "refit") -> Pendings:
        world = num_trainers + len(self.engines)
        return Pendings([e.submit("join", host, port, num_trainers + i, world, num_trainers,
                                  timeout_s, name) for i, e in enumerate(self.engines)])

    def refit_async(self) -> Pendings:
        return Pendings([e.submit("refit") for e in self.engines])

    def call(self, command: str, *args: Any) -> list[Any]:
        return Pendings([e.submit(command, *args) for e in self.engines]).result()

    def close(self) -> None:
        for engine in self.engines:
            engine.close()


class Pendings:
    """Commands in flight on several engines; `result()` waits for all, then raises the first
    failure (every engine is waited for, so none is left busy)."""

    def __init__(self, pending: list[Pending]) -> None:
        self.pending = pending

    def result(self, timeout_s: float = 600.0) -> list[Any]:
        out, errors = [], []
        for p in self.pending:
            try:
                out.append(p.result(timeout_s))
            except EngineError as e:
                errors.append(e)
        if errors:
            raise errors[0]
        return out
