"""A dedicated refit group: every training rank (0..T-1) then every inference rank (T..T+I-1).

Built straight on a TCPStore and a backend object, so it can be created inside a process that
already has a default group (torchrun) or vLLM's own groups, and never touches either. gloo on
CPU, NCCL on CUDA; every collective has a timeout, and a failure raises `RefitCommError` naming
this rank, its role and what it was doing. The first rank to fail posts an abort record in the
group's store, which every waiting rank reads within `ABORT_POLL_S` (see `RefitGroup.wait`), so
a death is felt everywhere in well under a second, not after the timeout. After a failure the
group is dead: `destroy()` it and create a new one (a fresh `name`, or the same name once every
old member has left).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import random
import re
import socket
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import torch
import torch._C._distributed_c10d as c10d
import torch.distributed as dist

from common.errors import RefitCommError

log = logging.getLogger(__name__)

_NCCL_ENV = {
    # On an NCCL error or timeout the watchdog aborts the communicator but leaves the process
    # alive (the default tears the whole training process down); our wait raises instead.
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "2",
}
_POLL_S = 20e-6  # NCCL's own blocking wait sleeps 1 ms between polls: too coarse per bucket
_GLOO_POLL_S = 5e-4  # the longest sleep between polls of a gloo work
_BACKEND_GRACE_S = 30.0
ABORT_POLL_S = 0.25  # how often a waiting rank looks for another rank's abort record
_ABORT_KEY = "abort"
# Collectives given up on, with their group, kept alive until their own timeout has passed.
_ABANDONED: list[tuple[float, dist.Work, object]] = []


class _Abandoned(Exception):
    """Another rank's abort record (or the store's death) ended this rank's wait."""


def _spin(work: dist.Work, seconds: float, longest_sleep_s: float) -> bool:
    """Poll `work` for up to `seconds`, sleeping from `_POLL_S` up to `longest_sleep_s`
    between polls; whether it completed. (A gloo `wait(timeout)` cannot serve here: from
    one torch version to the next, a timed-out wait leaves the work running or failed.)"""
    end, nap = time.monotonic() + seconds, _POLL_S
    while not work.is_completed():
        if time.monotonic() >= end:
            return False
        time.sleep(nap)
        nap = min(nap * 2, longest_sleep_s)
    return True


def _clean(error: BaseException) -> str:
    """A backend's message without its source location and sign-off (gloo ends "GLHF!")."""
    text = re.sub(r"\[[^\]]*\.(cc|cpp|h):\d+\]\s*", "", str(error)).strip()
    text = re.sub(r"\s*This is typically caused by.*$", "", text, flags=re.S)
    return re.sub(r"\s*GLHF!?\s*\S*\s*$", "", text).strip()


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
    to the other ranks out of band: the training job's own group, or the engine's join call).
    Picked below the kernel's ephemeral range where it can, so that the outgoing connections
    made before the store binds it (Ray, gloo, HTTP) cannot take it meanwhile."""
    below = range(max(1024, _ephemeral_low() - 12000), _ephemeral_low())
    for port in random.Random().sample(below, min(64, len(below))):
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 0


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
        self.aborted: str | None = None  # why this rank gave the group up, once it has
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
            self._control = dist.PrefixStore(f"refit/{name}/control/", self._store)
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
        opts.timeout = self._backend_timeout()
        return self._pg.broadcast([tensor], opts)

    def _backend_timeout(self) -> timedelta:
        """The backend's own timeout for a collective: past `wait`'s deadline, so that the
        wait (which says what expired) decides, and an abandoned op ends some time later."""
        return timedelta(seconds=self.timeout_s + _BACKEND_GRACE_S)

    def wait(self, work: dist.Work, what: str) -> None:
        """Finish `work` within the timeout or raise `RefitCommError` saying what it was.

        While it waits, this rank looks for an abort record in the group's store every
        `ABORT_POLL_S`: the first rank whose collective fails (or times out) writes one, so
        every other rank gives up within that interval, whatever the timeout, and names the
        rank that failed first. A store that stops answering (rank 0, its host, died) counts
        as an abort. An abandoned collective is never reused: the group is dead afterwards.
        """
        if self.aborted is not None:
            raise RefitCommError(f"{self.who}: {what} refused: the refit group was abandoned "
                                 f"({self.aborted}); destroy and rebuild it")
        t0 = time.monotonic()
        try:
            self._wait(work, t0 + self.timeout_s, what)
        except _Abandoned as e:
            self._abandon(work, str(e))
            raise RefitCommError(f"{self.who}: {what} abandoned after "
                                 f"{time.monotonic() - t0:.1f}s: {e}{self._members()}") from None
        except Exception as e:  # noqa: BLE001 - rewrap with who/where, tell the others
            cause = _clean(e) or type(e).__name__
            earlier = self._read_abort()  # another rank's failure may be the root cause
            self._abandon(work, cause)
            if earlier is None:
                self._post_abort(f"{what}: {cause}")
            raise RefitCommError(
                f"{self.who}: {what} failed after {time.monotonic() - t0:.1f}s "
                f"(timeout {self.timeout_s:.0f}s; a peer probably died or left the refit"
                f"{self._members()}): {cause}" + (f"; {earlier}" if earlier else "")
            ) from e

    def _wait(self, work: dist.Work, deadline: float, what: str) -> None:
        """Wait in slices of `ABORT_POLL_S`, reading the abort record between them."""
        # NCCL kernels finish in microseconds; a gloo op on its thread in milliseconds.
        longest_sleep_s = _POLL_S if self.backend == "nccl" else _GLOO_POLL_S
        while True:
            left = deadline - time.monotonic()
            if _spin(work, min(ABORT_POLL_S, max(left, 0.0)), longest_sleep_s):
                work.wait()  # raises the collective's own error, if any
                return
            if record := self._read_abort():
                raise _Abandoned(record)
            if time.monotonic() >= deadline:
                raise TimeoutError(f"no completion within the refit timeout "
                                   f"({self.timeout_s:.0f}s: RefitConfig.timeout_s)")

    def _post_abort(self, cause: str) -> None:
        """Write this rank's failure as the group's abort record, unless one is there."""
        record = json.dumps({"who": self.who, "cause": cause})
        with contextlib.suppress(Exception):  # a dead store: the others notice it themselves
            self._control.compare_set(_ABORT_KEY, "", record)

    def _read_abort(self) -> str | None:
        """The first failure another rank posted, or the store's own death; else None."""
        try:
            if not self._control.check([_ABORT_KEY]):
                return None
            record = json.loads(self._control.get(_ABORT_KEY))
        except Exception as e:  # noqa: BLE001 - the store's host died or left
            return (f"the refit group's store stopped answering ({_clean(e)}): refit rank 0 "
                    f"(trainer), which hosts it, probably died")
        return f"{record['who']} failed first: {record['cause']}"

    def _abandon(self, work: dist.Work, why: str) -> None:
        """Keep what the collective still holds alive (its buffers may yet be written, and
        dropping the last reference blocks until it times out); the group is dead. An NCCL
        communicator is aborted so that its kernels stop spinning."""
        self.aborted = why
        _ABANDONED[:] = [entry for entry in _ABANDONED if entry[0] > time.monotonic()]
        _ABANDONED.append((time.monotonic() + self.timeout_s + 2 * _BACKEND_GRACE_S, work,
                           self._pg))
        if self.backend == "nccl" and self._pg is not None:
            with contextlib.suppress(Exception):
                self._pg.abort()

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
        opts = c10d.AllgatherOptions()
        opts.timeout = self._backend_timeout()
        self.wait(self._pg.allgather([outs], [mine], opts), what)
        return [bytes(o.cpu().numpy().tobytes()).rstrip(b"\0") for o in outs]

    def destroy(self) -> None:
        """Leave the group (after a failure, abort it); safe to call twice."""
        pg, self._pg = getattr(self, "_pg", None), None
        if pg is not None and self.backend == "nccl":
            with contextlib.suppress(Exception):
                pg.abort()
        self._store = self._control = None
