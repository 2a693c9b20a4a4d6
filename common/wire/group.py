"""The refit group over gloo (CPU) or NCCL (CUDA): the default `Transport`.

Built straight on a TCPStore and a backend object, so it can be created inside a process that
already has a default group (torchrun) or vLLM's own groups, and never touches either. Every
collective has a timeout, and a failure raises `RefitCommError` naming this rank, its role and
what it was doing; the abort record, the waits' deadline and the messages are the transport's
(`common.wire.transport`). After a failure the group is dead: `destroy()` it and create a new one
(a fresh `name`, or the same name once every old member has left).
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import socket
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import torch
import torch._C._distributed_c10d as c10d
import torch.distributed as dist

from common.wire.addresses import local_address_toward
from common.wire.transport import Subgroup, Transport, padded

log = logging.getLogger(__name__)

_NCCL_ENV = {
    # On an NCCL error or timeout the watchdog aborts the communicator but leaves the process
    # alive (the default tears the whole training process down); our wait raises instead.
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "2",
}
_POLL_S = 20e-6  # NCCL's own blocking wait sleeps 1 ms between polls: too coarse per bucket
_GLOO_POLL_S = 5e-4  # the longest sleep between polls of a gloo work
_BACKEND_GRACE_S = 30.0
# Collectives given up on, with their group, kept alive until their own timeout has passed.
_ABANDONED: list[tuple[float, dist.Work, object]] = []


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


class RefitGroup(Transport):
    """The refit group of this process. Rank 0 (the first training rank) hosts the TCPStore."""

    def __init__(self, *, host: str, port: int, rank: int, world_size: int, num_trainers: int,
                 timeout_s: float, device: torch.device | str | None = None,
                 name: str = "refit", rank_names: dict[int, str] | None = None) -> None:
        t0 = time.perf_counter()
        super().__init__(host=host, port=port, rank=rank, world_size=world_size,
                         num_trainers=num_trainers, timeout_s=timeout_s, device=device,
                         name=name, rank_names=rank_names)
        self.backend = "nccl" if self.device.type == "cuda" else "gloo"
        self._subgroups: list[object] = []  # backend groups of `subgroup`, aborted with ours
        self._broadcast_options: dict[tuple[int, bool], dist.BroadcastOptions] = {}
        self.captures_broadcasts = self.backend == "nccl"
        try:
            self._pg = self._backend_group(self._data_store, rank, world_size)
        except Exception as e:  # noqa: BLE001 - rewrap with who/where
            raise self.join_error(e) from e
        log.info("%s joined refit group %r (%s, world %d) in %.2fs", self.label, name,
                 self.backend, world_size, time.perf_counter() - t0)

    def _backend_group(self, store: dist.Store, rank: int, size: int) -> object:
        """A gloo or NCCL group of `size` ranks meeting in `store`, with the refit timeout."""
        timeout = timedelta(seconds=self.timeout_s)
        if self.backend == "nccl":
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timeout
            with _env(_NCCL_ENV):
                return dist.ProcessGroupNCCL(store, rank, size, opts)
        # gloo listens on this rank's address on the route to rank 0's `host`
        opts = dist.ProcessGroupGloo._Options()
        opts._timeout = timeout
        opts._devices = [dist.ProcessGroupGloo.create_device(
            hostname=local_address_toward(self.host, self.port))]
        return dist.ProcessGroupGloo(store, rank, size, opts)

    supports_subgroups = True

    def _new_subgroup(self, ranks: tuple[int, ...], key: str) -> object:
        """The backend group of `ranks` (`Transport.subgroup`)."""
        pg = self._backend_group(dist.PrefixStore(f"sub/{key}/", self._data_store),
                                 ranks.index(self.rank), len(ranks))
        self._subgroups.append(pg)
        return pg

    def drop_subgroups(self) -> None:
        old, self._subgroups = self._subgroups, []
        if self.backend == "nccl":  # a communicator's resources go with it, not with the GC
            for pg in old:
                with contextlib.suppress(Exception):
                    pg.abort()

    def _broadcast(self, tensor: torch.Tensor, src: int, handle: object = None) -> dist.Work:
        return (handle or self._pg).broadcast([tensor], self._options(src, True))

    def capture_broadcast(self, tensor: torch.Tensor, src: int,
                          sub: Subgroup | None = None) -> None:
        # not async: ProcessGroupNCCL launches it on the current (capturing) stream, no
        # side stream to join back before the capture ends
        if sub is None:
            self._pg.broadcast([tensor], self._options(src, False))
        else:
            sub.handle.broadcast([tensor], self._options(sub.ranks.index(src), False))

    def _options(self, src: int, async_op: bool) -> dist.BroadcastOptions:
        """One options object per root, made once: a collective's host time counts per
        bucket."""
        if (opts := self._broadcast_options.get((src, async_op))) is None:
            opts = self._broadcast_options[src, async_op] = dist.BroadcastOptions()
            opts.rootRank, opts.rootTensor, opts.timeout = src, 0, self._backend_timeout()
            if not async_op:  # the eager ones keep the backend's default
                opts.asyncOp = False
        return opts

    def _backend_timeout(self) -> timedelta:
        """The backend's own timeout for a collective: past `wait`'s deadline, so that the
        wait (which says what expired) decides, and an abandoned op ends some time later."""
        return timedelta(seconds=self.timeout_s + _BACKEND_GRACE_S)

    def _wait_for(self, work: dist.Work, deadline: float) -> None:
        """Poll `work.is_completed()` (a gloo `wait(timeout)` cannot serve here: from one
        torch version to the next, a timed-out wait leaves the work running or failed)."""
        self._poll(work.is_completed, deadline, self._longest_poll_s())
        work.wait()  # raises the collective's own error, if any

    def _longest_poll_s(self) -> float:
        # NCCL kernels finish in microseconds; a gloo op on its thread in milliseconds.
        return _POLL_S if self.backend == "nccl" else _GLOO_POLL_S

    def wait_first(self, pending: dict[object, list[tuple[dist.Work, str]]]) -> object:
        """The first entry of `pending` whose works have all completed (`Transport`)."""
        found: list[object] = []

        def ready() -> bool:
            for key, works in pending.items():
                if all(work.is_completed() for work, _ in works):
                    found.append(key)
                    return True
            return False

        works = [work for entry in pending.values() for work, _ in entry]
        whats = [what for entry in pending.values() for _, what in entry]
        what = "waiting for any of " + ", ".join(whats[:4]) + (
            f" and {len(whats) - 4} more" if len(whats) > 4 else "")
        self._guarded(works, what, lambda deadline: self._poll(ready, deadline,
                                                               self._longest_poll_s()))
        for work, what in pending[found[0]]:
            self.wait(work, what)  # raises the collective's own error, if any
        return found[0]

    def _abandon(self, work: dist.Work, why: str) -> None:
        """Keep what the collective still holds alive (its buffers may yet be written, and
        dropping the last reference blocks until it times out); the group is dead. An NCCL
        communicator is aborted so that its kernels stop spinning."""
        self.aborted = why
        _ABANDONED[:] = [entry for entry in _ABANDONED if entry[0] > time.monotonic()]
        _ABANDONED.append((time.monotonic() + self.timeout_s + 2 * _BACKEND_GRACE_S, work,
                           self._pg))
        if self.backend == "nccl":
            for pg in [self._pg, *self._subgroups]:
                with contextlib.suppress(Exception):
                    pg and pg.abort()

    def all_gather_bytes(self, data: bytes, size: int, what: str) -> list[bytes]:
        """Every rank's `data` (truncated / zero-padded to `size` bytes), in rank order."""
        mine = padded(data, size, self.device)
        outs = [torch.empty_like(mine) for _ in range(self.world_size)]
        opts = c10d.AllgatherOptions()
        opts.timeout = self._backend_timeout()
        self.wait(self._pg.allgather([outs], [mine], opts), what)
        return [bytes(o.cpu().numpy().tobytes()).rstrip(b"\0") for o in outs]

    def destroy(self) -> None:
        """Leave the group (after a failure, abort it); safe to call twice. Rank 0 first
        lets the other trainers read its last verdict (`Transport.linger_for_verdict`)."""
        self.linger_for_verdict()
        pgs = [getattr(self, "_pg", None), *getattr(self, "_subgroups", [])]
        self._pg, self._subgroups = None, []
        if self.backend == "nccl":
            for pg in pgs:
                with contextlib.suppress(Exception):
                    pg and pg.abort()
        self._store = self._data_store = self._control = None
