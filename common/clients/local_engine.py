"""`LocalEngine`: a vLLM `LLM` with the refit backend in a child process of the trainer.

The child (`common.in_vllm.llm_host.serve`, launched by name) starts with a clean environment
(no torchrun RANK / MASTER_* leaking into vLLM) and runs `LLMHost`; this side is an
`EngineClient` whose calls reach the host's methods by name, one at a time. Weights travel
only over the refit group. It is the fast engine of tests and demos (in-process worker: starts
in seconds); `vllm serve` servers are driven by `common.clients.http_engine.HttpEngine`
through the same interface.
"""

from __future__ import annotations

import contextlib
import importlib
import multiprocessing as mp
import os
import threading
import time
import weakref
from abc import abstractmethod
from typing import Any

from common.clients.engine_client import Completion, EngineClient, EngineError, PauseMode
from common.engine.config import EngineConfig
from common.engine.state import RefitState

HOST_SERVE = "common.in_vllm.llm_host:serve"  # the child's entry point, imported there only
# What the forkserver imports once, so that each engine forked from it starts without paying
# vLLM's import (seconds, most of a tiny engine's start).
FORKSERVER_PRELOAD = ("vllm.entrypoints.llm", "common.in_vllm.llm_host")
START_METHODS = ("forkserver", "spawn")

# Variables of the training launcher that must not reach vLLM (it would join the wrong group).
_LAUNCHER_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                  "ROLE_RANK", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                  "GROUP_WORLD_SIZE", "ROLE_NAME")


def is_launcher_var(name: str) -> bool:
    """Whether torchrun set `name` for the trainer: an engine started from a trainer must not
    see it (with TORCHELASTIC_USE_AGENT_STORE vLLM's own process group would wait for the
    trainers' agent store as a client, forever)."""
    return name in _LAUNCHER_VARS or name.startswith("TORCHELASTIC_")


def by_name(dotted: str) -> Any:
    """The object `module:attribute` names, imported now: engine hosts are launched by name, so
    the training side never imports the code that runs inside vLLM."""
    module, _, attribute = dotted.partition(":")
    return getattr(importlib.import_module(module), attribute)


def run_by_name(dotted: str, env: dict[str, str], *args: Any) -> None:
    """A child process's target: call the function `dotted` names with `args`, in `env` (the
    parent's environment when it started the child: a forkserver's own may be older)."""
    os.environ.clear()
    os.environ.update(env)
    by_name(dotted)(*args)


def process_context(start_method: str) -> Any:
    """A multiprocessing context for engine processes: "forkserver" forks each engine from one
    server process that imported `FORKSERVER_PRELOAD` (Python keeps one forkserver per process:
    the first caller's preload list holds for all), "spawn" starts a fresh interpreter."""
    if start_method not in START_METHODS:
        raise ValueError(f"start_method {start_method!r} is not one of {START_METHODS}")
    ctx = mp.get_context(start_method)
    if start_method == "forkserver":
        ctx.set_forkserver_preload(list(FORKSERVER_PRELOAD))
    return ctx


class HostedEngine(EngineClient):
    """An `EngineClient` whose engine is an `LLMHost` reached by method name (`_call`): in a
    child process (`LocalEngine`) or a Ray actor (`common.clients.ray_engine.RayEngine`)."""

    @abstractmethod
    def _call(self, method: str, timeout_s: float | None = None, **kwargs: Any) -> Any:
        """Run `LLMHost.<method>(**kwargs)` in the engine's process within `timeout_s`."""

    def _num_workers(self) -> int:
        return self._call("num_workers")

    def _pause(self, mode: PauseMode, clear_cache: bool) -> None:
        self._call("pause", mode=mode, clear_cache=clear_cache)

    def _resume(self) -> None:
        self._call("resume")

    def _init(self, info: dict[str, Any], timeout_s: float) -> None:
        self._call("init", timeout_s + self.timeout_s, info=info)

    def _start(self) -> None:
        self._call("start_update")

    def _update(self, info: dict[str, Any], timeout_s: float) -> None:
        self._call("update", timeout_s, info=info)

    def _finish(self, version: str) -> None:
        self._call("finish", version=version)

    def _get_version(self) -> str:
        return self._call("get_version")

    def _state(self) -> RefitState:
        return self._call("state")

    def _fp8_targets(self) -> dict | None:
        return self._call("fp8_targets")

    def _is_paused(self) -> bool:
        return self._call("is_paused")

    def _set_version(self, version: str) -> None:
        self._call("set_version", version=version)

    def _generate(self, prompts: list[list[int]], max_tokens: int,
                  **sampling: Any) -> list[Completion]:
        outs = self._call("generate", prompts=prompts, max_tokens=max_tokens, sampling=sampling)
        return [Completion(**out) for out in outs]

    def read(self, names: list[str] | None = None, worker: int = 0) -> dict:
        """Copies of a worker's readable params by vLLM name (tests compare them); `worker`:
        its index in the engine (its TP rank, for TP > 1)."""
        return self._call("read", names=names, worker=worker)

    def apply_reports(self) -> list[dict]:
        """Per worker: how it applies refits (`common.in_vllm.backend`'s apply report)."""
        return self._call("apply_reports")

    def backend_origin(self) -> list[dict[str, str]]:
        """Per worker: the weight-transfer backend it runs and where its `common` lives."""
        return self._call("backend_origin")


class LocalEngine(HostedEngine):
    """One vLLM engine in a child process (module docstring)."""

    def __init__(self, config: EngineConfig, name: str | None = None,
                 timeout_s: float | None = None) -> None:
        super().__init__(name or f"local:{os.path.basename(config.model.rstrip('/'))}",
                         config.call_timeout_s if timeout_s is None else timeout_s)
        self.config = config
        ctx = process_context(config.start_method)
        self._conn, child = ctx.Pipe()
        self._lock = threading.Lock()
        launcher = {k: os.environ.pop(k) for k in list(os.environ) if is_launcher_var(k)}
        try:
            # Not daemonic: the engine may start vLLM's worker processes (TP > 1). The
            # finalizer stops it when this client is collected or the trainer exits, before
            # multiprocessing's own exit hook would wait for it.
            self._proc = ctx.Process(target=run_by_name, daemon=False,
                                     args=(HOST_SERVE, dict(os.environ), child, config))
            self._proc.start()
        finally:
            os.environ.update(launcher)
        self._stopper = weakref.finalize(self, _stop, self._proc, self._conn, self._lock)
        with self._lock:
            self._answer("start", config.start_timeout_s)

    def _call(self, method: str, timeout_s: float | None = None, **kwargs: Any) -> Any:
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        if not self._lock.acquire(timeout=timeout_s):
            raise TimeoutError(f"{method}: the engine was busy for {timeout_s:.0f}s")
        try:
            if not self._proc.is_alive():
                raise EngineError(f"engine {self.name}: process is gone (exit code "
                                  f"{self._proc.exitcode}); {method!r} not sent")
            try:
                self._conn.send((method, kwargs))
            except OSError:  # the pipe broke: the process is dying
                raise self._died(method) from None
            return self._answer(method, timeout_s)
        finally:
            self._lock.release()

    def _answer(self, method: str, timeout_s: float) -> Any:
        deadline = time.monotonic() + timeout_s
        try:
            while not self._conn.poll(0.1):
                if not self._proc.is_alive():
                    raise self._died(method)
                if time.monotonic() > deadline:
                    raise EngineError(f"engine {self.name}: no answer to {method!r} in "
                                      f"{timeout_s:.0f}s")
            status, value = self._conn.recv()
        except (EOFError, OSError):  # the pipe closed under the call: the process died
            raise self._died(method) from None
        if status == "ok":
            return value
        kind, message, trace = value
        error = EngineError(f"engine {self.name}: {method!r} failed: {kind}: {message}")
        error.add_note(f"the engine process's traceback:\n{trace}")
        raise error

    def _died(self, method: str) -> EngineError:
        self._proc.join(timeout=5)  # for its exit code
        return EngineError(f"engine {self.name}: process died (exit code "
                           f"{self._proc.exitcode}) during {method!r}")

    def kill(self) -> None:
        """Kill the engine process at once (tests of a peer dying mid-refit)."""
        self._proc.kill()
        self._proc.join()

    def close(self) -> None:
        super().close()
        self._stopper()


def _stop(proc: mp.process.BaseProcess, conn: Any, lock: threading.Lock) -> None:
    """Ask the engine process to stop (it shuts vLLM down), kill it if it does not in 30 s."""
    if proc.is_alive():
        if lock.acquire(timeout=1.0):
            with contextlib.suppress(OSError):
                conn.send(("stop", {}))
            lock.release()
        proc.join(timeout=30)
        if proc.is_alive():
            proc.kill()
            proc.join()
