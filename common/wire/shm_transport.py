"""Same-host shared memory as a refit transport (CPU): a colocated engine, no network stack.

Every rank issues the same broadcasts in the same order, so a sequence number names each one.
The source copies the tensor into a shared-memory segment named after the group and that
number and publishes it in the group's store; each receiver, in `wait`, waits for the
publication, copies the bytes out and acknowledges. The source unlinks a segment once every
other rank has acknowledged it (at the latest when it leaves), and at most `MAX_IN_FLIGHT` of
its segments wait for that (its `wait` holds it back), so memory stays bounded. While
waiting, a rank also watches the processes it waits for: a dead peer fails the wait within
`ABORT_POLL_S`, as does the abort record or a store that stops answering
(`common.wire.transport`).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing import resource_tracker, shared_memory
from pathlib import Path

import numpy as np
import torch

from common.wire.transport import Abandoned, Transport

MAX_IN_FLIGHT = 4  # a source's segments not yet read by every other rank
LINGER_S = 10.0  # how long `destroy` waits for the peers to read this rank's last segments
_LONGEST_SLEEP_S = 5e-4


@dataclass
class _Work:
    seq: int
    tensor: torch.Tensor
    src: int
    done: bool = False


def _alive(pid: int) -> bool:
    """Whether process `pid` runs (a zombie does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def _bytes_of(tensor: torch.Tensor) -> np.ndarray:
    return tensor.detach().reshape(-1).view(torch.uint8).numpy()


class ShmTransport(Transport):
    """One rank of a refit group whose ranks share this host (module docstring)."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        if self.device.type != "cpu":
            raise ValueError(f"{self.label}: ShmTransport moves CPU tensors, not {self.device}")
        self._seq = 0
        self._segments: dict[int, shared_memory.SharedMemory] = {}
        store, keys = self._data_store, [f"pid/{r}" for r in range(self.world_size)]
        try:
            if self.rank == 0:
                store.set("nonce", secrets.token_hex(4))
            store.set(f"pid/{self.rank}", str(os.getpid()))
            store.wait(["nonce", *keys], timedelta(seconds=self.timeout_s))
            self._prefix = f"refit-{store.get('nonce').decode()}-"
            self._pids = [int(store.get(k)) for k in keys]
        except Exception as e:  # noqa: BLE001 - rewrap with who/where
            raise self.join_error(e) from e

    def _broadcast(self, tensor: torch.Tensor, src: int, handle: object = None) -> _Work:
        work = _Work(self._seq, tensor, src)
        self._seq += 1
        if self.rank == src:
            data = _bytes_of(tensor)
            shm = shared_memory.SharedMemory(name=self._prefix + str(work.seq), create=True,
                                             size=max(data.size, 1))
            np.frombuffer(shm.buf, dtype=np.uint8, count=data.size)[:] = data
            self._segments[work.seq] = shm
            self._data_store.set(f"bc/{work.seq}", str(data.size))
        return work

    def _wait_for(self, work: _Work, deadline: float) -> None:
        if work.done:
            return
        if self.rank == work.src:  # held back while too many segments wait to be read
            others = [r for r in range(self.world_size) if r != self.rank]
            self._poll(self._asking(lambda: self._reap() < MAX_IN_FLIGHT), deadline,
                       _LONGEST_SLEEP_S, lambda: self._dead(others))
        else:
            self._poll(self._asking(lambda: self._data_store.check([f"bc/{work.seq}"])),
                       deadline, _LONGEST_SLEEP_S, lambda: self._dead([work.src]))
            shm = shared_memory.SharedMemory(name=self._prefix + str(work.seq))
            resource_tracker.unregister(shm._name, "shared_memory")  # the source unlinks it
            try:
                out = _bytes_of(work.tensor)
                out[:] = np.frombuffer(shm.buf, dtype=np.uint8, count=out.size)
            finally:
                shm.close()
            self._data_store.add(f"ack/{work.seq}", 1)
        work.done = True

    def _asking(self, ask: Callable[[], bool]) -> Callable[[], bool]:
        """`ask` (a store query), with a store that stops answering an abort like any other."""
        def ready() -> bool:
            try:
                return ask()
            except Exception as e:  # noqa: BLE001 - the store's host died or left
                raise Abandoned(self.read_abort() or f"the store failed: {e}") from None
        return ready

    def _dead(self, peers: list[int]) -> str | None:
        """Which of `peers`' processes died, or None."""
        if dead := [r for r in peers if not _alive(self._pids[r])]:
            return f"refit rank {dead[0]} (pid {self._pids[dead[0]]}) died"
        return None

    def _reap(self) -> int:
        """Unlink the segments every other rank has read; how many are left."""
        for seq in list(self._segments):
            if int(self._data_store.add(f"ack/{seq}", 0)) >= self.world_size - 1:
                self._unlink(seq)
        return len(self._segments)

    def _unlink(self, seq: int) -> None:
        shm = self._segments.pop(seq)
        shm.close()
        shm.unlink()

    def _abandon(self, work: _Work, why: str) -> None:
        self.aborted = why

    def destroy(self) -> None:
        """Leave: first let the live peers read this rank's last segments (a peer may still
        be reading the end-of-refit status), then unlink them; rank 0, which hosts the store
        the peers acknowledge through, also waits for every live peer to leave. Each wait
        lasts at most `LINGER_S`."""
        self.linger_for_verdict()
        deadline = time.monotonic() + min(self.timeout_s, LINGER_S)
        with contextlib.suppress(Exception):  # a dead store or peer: nobody is left to read
            self._linger(self._reap, deadline)
            self._data_store.add("left", 1)
            if self.rank == 0:
                self._linger(lambda: int(self._data_store.add("left", 0)) < self.world_size,
                             deadline)
        for seq in list(self._segments):
            self._unlink(seq)
        self._store = self._data_store = self._control = None

    def _linger(self, waiting, deadline: float) -> None:
        """Sleep while `waiting()`, unless this group was abandoned, a peer died or the
        deadline passed."""
        others = [r for r in range(self.world_size) if r != self.rank]
        while (self.aborted is None and waiting() and time.monotonic() < deadline
               and all(_alive(self._pids[r]) for r in others)):
            time.sleep(_LONGEST_SLEEP_S)
