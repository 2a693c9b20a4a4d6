"""A dedicated refit group: every training rank (0..T-1) then every inference rank (T..T+I-1).

Built straight on a TCPStore and a backend object, so it can be created inside a process that
already has a default group (torchrun) or vLLM's own groups, and never touches either. gloo on
CPU, NCCL on CUDA; every collective has a timeout, and a failure raises `RefitCommError` naming
this rank, its role and what it was doing. After a failure the group is dead: `destroy()` it and
create a new one (a fresh `name`, or the same name once every old member has left).
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import time
from collections.abc import Iterator
from datetime import timedelta

import torch
import torch.distributed as dist

from common.errors import RefitCommError

log = logging.getLogger(__name__)

_NCCL_ENV = {
    # On an NCCL error or timeout the watchdog aborts the communicator but leaves the process
    # alive (the default tears the whole training process down); our wait raises instead.
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "2",
}
_POLL_S = 20e-6  # NCCL's own blocking wait sleeps 1 ms between polls: too coarse per bucket


@contextlib.contextmanager
def _env(values: dict[str, str]) -> Iterator[None]:
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on this host now, for rank 0 to host the refit group's store on (hand it
    to the other ranks out of band: the training job's own group, or the engine's join call)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class RefitGroup:
    """The refit group of this process. Rank 0 (the first training rank) hosts the TCPStore."""

    def __init__(
        self,
        *,
        host: str,
        port: int,
        rank: int,
        world_size: int,
        num_trainers: int,
        timeout_s: float,
        device: torch.device | str | None = None,
        name: str = "refit",
        rank_names: dict[int, str] | None = None,
    ) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"refit group rank {rank} outside world size {world_size}")
        if not 1 <= num_trainers <= world_size:
            raise ValueError(f"num_trainers={num_trainers} must be in 1..world_size={world_size}")
        self.rank, self.world_size, self.num_trainers = rank, world_size, num_trainers
        self.timeout_s = float(timeout_s)
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.backend = "nccl" if self.device.type == "cuda" else "gloo"
        self.name = name
        # Who holds which ranks (e.g. {2: "engine http://host:8000", ..}), named in failures.
        self.rank_names = dict(rank_names or {})
        timeout = timedelta(seconds=self.timeout_s)
        t0 = time.perf_counter()
        try:
            self._store = dist.TCPStore(
                host, port, world_size, is_master=rank == 0, timeout=timeout,
                wait_for_workers=False,
            )
            store = dist.PrefixStore(f"refit/{name}/", self._store)
            if self.backend == "nccl":
                opts = dist.ProcessGroupNCCL.Options()
                opts._timeout = timeout
                with _env(_NCCL_ENV):
                    self._pg = dist.ProcessGroupNCCL(store, rank, world_size, opts)
            else:
                self._pg = dist.ProcessGroupGloo(store, rank, world_size, timeout)
        except Exception as e:  # noqa: BLE001 - rewrap with who/where
            raise RefitCommError(
                f"{self.who}: could not join refit group {name!r} at {host}:{port} "
                f"within {self.timeout_s:.0f}s: {e}"
            ) from e
        log.info("%s joined refit group %r (%s, world %d) in %.2fs", self.who, name,
                 self.backend, world_size, time.perf_counter() - t0)

    @property
    def is_trainer(self) -> bool:
        return self.rank < self.num_trainers

    @property
    def who(self) -> str:
        role = "trainer" if self.is_trainer else "receiver"
        return f"refit rank {self.rank}/{self.world_size} ({role})"

    def broadcast(self, tensor: torch.Tensor, src: int) -> dist.Work:
        """Start an async broadcast of `tensor` from `src`; finish it with `wait`."""
        opts = dist.BroadcastOptions()
        opts.rootRank = src
        opts.rootTensor = 0
        opts.timeout = timedelta(seconds=self.timeout_s)
        return self._pg.broadcast([tensor], opts)

    def wait(self, work: dist.Work, what: str) -> None:
        """Finish `work` within the timeout or raise `RefitCommError` saying what it was."""
        t0 = time.perf_counter()
        try:
            if self.backend == "nccl":
                self._poll(work, t0 + self.timeout_s)
            work.wait(timedelta(seconds=self.timeout_s))
        except Exception as e:  # noqa: BLE001 - rewrap with who/where
            raise RefitCommError(
                f"{self.who}: {what} failed after {time.perf_counter() - t0:.1f}s "
                f"(timeout {self.timeout_s:.0f}s; a peer probably died or left the refit"
                f"{self._members()}): {e}"
            ) from e

    def _members(self) -> str:
        """The ranks of `rank_names` as runs (e.g. `; peers: ranks 2-3 engine X`), or ""."""
        runs: list[list] = []
        for rank in sorted(self.rank_names):
            if runs and runs[-1][2] == self.rank_names[rank] and runs[-1][1] == rank - 1:
                runs[-1][1] = rank
            else:
                runs.append([rank, rank, self.rank_names[rank]])
        parts = [f"rank {a} {n}" if a == b else f"ranks {a}-{b} {n}" for a, b, n in runs]
        return f"; peers: {', '.join(parts)}" if parts else ""

    def _poll(self, work: dist.Work, deadline: float) -> None:
        """Host-side wait for an NCCL work with a deadline; aborts the group when it passes."""
        while not work.is_completed():
            if time.perf_counter() > deadline:
                self.destroy()  # abort the communicator so its kernels stop spinning
                raise TimeoutError("NCCL collective did not complete")
            time.sleep(_POLL_S)

    def broadcast_bytes(self, data: bytes | None, src: int, what: str) -> bytes:
        """Broadcast a byte string of any length from `src` (two collectives: length, data)."""
        length = torch.tensor([len(data) if data is not None else 0], device=self.device)
        self.wait(self.broadcast(length, src), f"{what} (length)")
        size = int(length.item())
        buf = torch.empty(size, dtype=torch.uint8, device=self.device)
        if self.rank == src:
            buf.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
        self.wait(self.broadcast(buf, src), what)
        return bytes(buf.cpu().numpy().tobytes())

    def all_gather_bytes(self, data: bytes, size: int, what: str) -> list[bytes]:
        """Every rank's `data` (truncated / zero-padded to `size` bytes), in rank order."""
        mine = torch.zeros(size, dtype=torch.uint8)
        raw = data[:size]
        if raw:
            mine[: len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
        mine = mine.to(self.device)
        outs = [torch.empty_like(mine) for _ in range(self.world_size)]
        self.wait(self._pg.allgather([outs], [mine]), what)
        return [bytes(o.cpu().numpy().tobytes()).rstrip(b"\0") for o in outs]

    def destroy(self) -> None:
        """Leave the group (after a failure, abort it); safe to call twice."""
        pg, self._pg = getattr(self, "_pg", None), None
        if pg is not None and self.backend == "nccl":
            with contextlib.suppress(Exception):
                pg.abort()
        self._store = None
