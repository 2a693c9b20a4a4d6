"""What the refit protocol needs from the byte mover, and what every transport shares.

`RefitSender` / `RefitReceiver` (and the plan handshake) use only this interface: who this
rank is (`label`), `broadcast` a tensor from a source rank (asynchronous) and `wait` for it,
`broadcast_bytes` / `all_gather_bytes` for the handshake and the end-of-refit status, and
`destroy`. A transport supplies the byte moving (`broadcast`, `_wait_for`, `_abandon`); the
control plane is shared: ranks 0..T-1 train, the others infer; rank 0 hosts a TCPStore that
holds the group's abort record, which the first rank to fail writes and every waiting rank
reads every `ABORT_POLL_S`, so a failure is felt everywhere in well under a second whatever
the timeout; a store that stops answering (rank 0 died) counts as an abort. After a failure
the transport is dead: destroy it and build a new one. Transports: `common.wire.group.RefitGroup`
(gloo / NCCL), `common.wire.shm_transport.ShmTransport` (same-host shared memory, CPU).
"""

from __future__ import annotations

import contextlib
import json
import re
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from common.errors import RefitAborted, RefitCommError, RefitError
from common.wire.addresses import tcp_store

ABORT_POLL_S = 0.25  # how often a waiting rank looks for another rank's abort record
FIRST_SLEEP_S = 20e-6  # the first sleep between polls of a collective (then doubling)
_ABORT_KEY = "abort"
_VERDICT_KEY = "verdict/{}"
_VERDICT_READ_KEY = "verdict_read/{}"
VERDICT_LINGER_S = 10.0  # rank 0, leaving: the longest wait for the trainers to read a verdict


class Abandoned(RefitError):
    """Another rank's abort record (or the store's death) ended this rank's wait."""


def clean(error: BaseException) -> str:
    """A backend's message without its source location and sign-off (gloo ends "GLHF!")."""
    text = re.sub(r"\[[^\]]*\.(cc|cpp|h):\d+\]\s*", "", str(error)).strip()
    text = re.sub(r"\s*This is typically caused by.*$", "", text, flags=re.S)
    return re.sub(r"\s*GLHF!?\s*\S*\s*$", "", text).strip()


@dataclass(frozen=True)
class Subgroup:
    """Some ranks of the group (refit ranks, in order) with a backend group of their own: a
    broadcast in it reaches only them (shard-to-shard frames)."""

    ranks: tuple[int, ...]
    handle: Any


class Transport(ABC):
    """One rank of a refit group: the interface and the shared control plane (module doc)."""

    supports_subgroups = False  # `subgroup` works (else every worker takes whole buckets)
    captures_broadcasts = False  # `capture_broadcast` works (CUDA graphs of whole frames)

    def __init__(self, *, host: str, port: int, rank: int, world_size: int, num_trainers: int,
                 timeout_s: float, device: torch.device | str | None = None,
                 name: str = "refit", rank_names: dict[int, str] | None = None) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"refit group rank {rank} outside world size {world_size}")
        if not 1 <= num_trainers <= world_size:
            raise ValueError(f"num_trainers={num_trainers} must be in 1..world_size={world_size}")
        self.rank, self.world_size, self.num_trainers = rank, world_size, num_trainers
        self.timeout_s = float(timeout_s)
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.name, self.host, self.port = name, host, port
        self.aborted: str | None = None  # why this rank gave the group up, once it has
        # Who holds which ranks (e.g. {2: "engine http://host:8000", ..}), named in failures.
        self.rank_names = dict(rank_names or {})
        # Rank 0 (a trainer) publishes each refit's verdict when a caller commits it to the
        # engines (e.g. `EngineFleet.refit`); the other trainers wait for it.
        self.verdict_by_caller = False
        self.refits = 0  # end-of-refit status exchanges so far: the key of each verdict
        self._published: int | None = None  # rank 0: the last verdict it published
        self._moved = 0  # bytes broadcast since the last `take_bytes_moved`
        try:
            self._store = tcp_store(host, port, world_size, rank == 0, self.timeout_s,
                                    wait_for_workers=False)
        except Exception as e:  # noqa: BLE001 - rewrap with who/where
            raise self.join_error(e) from e
        self._data_store = dist.PrefixStore(f"refit/{name}/", self._store)
        self._control = dist.PrefixStore(f"refit/{name}/control/", self._store)

    def join_error(self, e: BaseException) -> RefitCommError:
        return RefitCommError(f"{self.label}: could not join refit group {self.name!r} at "
                              f"{self.host}:{self.port} within {self.timeout_s:.0f}s: {e}")

    @property
    def is_trainer(self) -> bool:
        return self.rank < self.num_trainers

    @property
    def label(self) -> str:
        role = "trainer" if self.is_trainer else "receiver"
        return f"refit rank {self.rank}/{self.world_size} ({role})"

    def broadcast(self, tensor: torch.Tensor, src: int, sub: Subgroup | None = None) -> Any:
        """Start broadcasting `tensor` from rank `src` (received into `tensor` elsewhere) to
        the whole group, or to `sub`'s ranks; returns a handle for `wait`. Its bytes count in
        `take_bytes_moved`."""
        self._moved += tensor.numel() * tensor.element_size()
        if sub is None:
            return self._broadcast(tensor, src)
        return self._broadcast(tensor, sub.ranks.index(src), sub.handle)

    def capture_broadcast(self, tensor: torch.Tensor, src: int,
                          sub: Subgroup | None = None) -> None:
        """Inside a CUDA graph capture: a broadcast of `tensor` from `src` to the whole group
        or to `sub`'s ranks, on the capturing stream, moving bytes each time the graph is
        replayed (count them with `count_moved`). Only where `captures_broadcasts`."""
        raise ValueError(f"{type(self).__name__} has no captured broadcasts")

    def count_moved(self, nbytes: int) -> None:
        """Bytes a replayed (captured) broadcast moved, for `take_bytes_moved`."""
        self._moved += nbytes

    def subgroup(self, ranks: list[int], key: str) -> Subgroup | None:
        """A subgroup of `ranks` (this rank among them), built by those ranks alone, in the
        same order of keys on each; None when `ranks` is the whole group (use the group)."""
        ranks = tuple(sorted(ranks))
        if not self.supports_subgroups:
            raise ValueError(f"{type(self).__name__} has no subgroups")
        if self.rank not in ranks:
            raise ValueError(f"{self.label} is not in subgroup {key} {list(ranks)}")
        if len(ranks) == self.world_size:
            return None
        try:
            return Subgroup(ranks, self._new_subgroup(ranks, key))
        except Exception as e:  # noqa: BLE001 - rewrap with who/where
            raise RefitCommError(f"{self.label}: could not build refit subgroup {key} of ranks "
                                 f"{list(ranks)} within {self.timeout_s:.0f}s: {clean(e)}"
                                 f"{self.members()}") from e

    def take_bytes_moved(self) -> int:
        """Bytes this rank sent or received by broadcast since the last call: what went over
        the wire for it, as the collectives were issued (not an encoded length)."""
        moved, self._moved = self._moved, 0
        return moved

    # --- what a transport supplies ---------------------------------------------------------
    @abstractmethod
    def _broadcast(self, tensor: torch.Tensor, src: int, handle: Any = None) -> Any:
        """Start broadcasting `tensor` from rank `src` (of subgroup `handle`, if given); a
        handle for `wait`."""

    def drop_subgroups(self) -> None:  # noqa: B027 - without subgroups there is none to drop
        """Release every subgroup built so far (a re-plan: nothing is pending in them)."""

    @abstractmethod
    def _wait_for(self, work: Any, deadline: float) -> None:
        """Return once `work` is done; raise `Abandoned` if `_read_abort` says so, or
        `TimeoutError` past `deadline` (time.monotonic()), polling at most every
        `ABORT_POLL_S`."""

    @abstractmethod
    def _abandon(self, work: Any, why: str) -> None:
        """Give up `work` for good (this transport is dead afterwards)."""

    @abstractmethod
    def destroy(self) -> None:
        """Leave the group (after a failure, abort it); safe to call twice."""

    # --- shared ----------------------------------------------------------------------------
    def wait(self, work: Any, what: str) -> None:
        """Finish `work` within the timeout or raise `RefitCommError` saying what it was,
        how long it waited and which rank failed first (the abort record)."""
        self._guarded(work, what, lambda deadline: self._wait_for(work, deadline))

    def wait_first(self, pending: dict[Any, list[tuple[Any, str]]]) -> Any:
        """The key of an entry of `pending` (key -> its (work, what) list) whose works have
        all ended, each then waited for as `wait` does (raising its error); within the
        timeout, reading the abort record. This base waits for the first entry; a transport
        that can tell which work ended first overrides it."""
        key = next(iter(pending))
        for work, what in pending[key]:
            self.wait(work, what)
        return key

    def _guarded(self, work: Any, what: str, run: Callable[[float], None]) -> None:
        """`run(deadline)` (a wait for `work`), its failure raised as `RefitCommError`: an
        abort record read (`Abandoned`), the deadline or the backend's error, which this
        rank then posts as the group's abort record unless another rank's is there."""
        if self.aborted is not None:
            raise RefitCommError(f"{self.label}: {what} refused: the refit group was abandoned "
                                 f"({self.aborted}); destroy and rebuild it")
        t0 = time.monotonic()
        try:
            run(t0 + self.timeout_s)
        except Abandoned as e:
            self._abandon(work, str(e))
            raise RefitCommError(f"{self.label}: {what} abandoned after "
                                 f"{time.monotonic() - t0:.1f}s: {e}{self.members()}") from None
        except Exception as e:  # noqa: BLE001 - rewrap with who/where, tell the others
            cause = clean(e) or type(e).__name__
            earlier = self.read_abort()  # another rank's failure may be the root cause
            self._abandon(work, cause)
            if earlier is None:
                self.post_abort(f"{what}: {cause}")
            raise RefitCommError(
                f"{self.label}: {what} failed after {time.monotonic() - t0:.1f}s "
                f"(timeout {self.timeout_s:.0f}s; a peer probably died or left the refit"
                f"{self.members()}): {cause}" + (f"; {earlier}" if earlier else "")
            ) from e

    def _poll(self, ready: Callable[[], bool], deadline: float, longest_sleep_s: float,
              peers_dead: Callable[[], str | None] | None = None) -> None:
        """Until `ready()`, sleeping from `FIRST_SLEEP_S` up to `longest_sleep_s` between
        polls; every `ABORT_POLL_S` the abort record is read (`Abandoned`) and `peers_dead()`
        asked (its reason raised); past `deadline` (time.monotonic()) `TimeoutError`."""
        nap, check_at = FIRST_SLEEP_S, time.monotonic() + ABORT_POLL_S
        while not ready():
            now = time.monotonic()
            if now >= check_at:
                if record := self.read_abort():
                    raise Abandoned(record)
                if peers_dead is not None and (why := peers_dead()):
                    raise RuntimeError(why)
                check_at = now + ABORT_POLL_S
            if now >= deadline:
                raise self.timed_out()
            time.sleep(nap)
            nap = min(nap * 2, longest_sleep_s)

    def timed_out(self) -> TimeoutError:
        return TimeoutError(f"no completion within the refit timeout ({self.timeout_s:.0f}s: "
                            f"RefitConfig.timeout_s)")

    def post_abort(self, cause: str) -> None:
        """Write this rank's failure as the group's abort record, unless one is there."""
        record = json.dumps({"rank": self.label, "cause": cause})
        with contextlib.suppress(Exception):  # a dead store: the others notice it themselves
            self._control.compare_set(_ABORT_KEY, "", record)

    def read_abort(self) -> str | None:
        """The first failure another rank posted, or the store's own death; else None."""
        try:
            if not self._control.check([_ABORT_KEY]):
                return None
            record = json.loads(self._control.get(_ABORT_KEY))
        except Exception as e:  # noqa: BLE001 - the store's host died or left
            return (f"the refit group's store stopped answering ({clean(e)}): refit rank 0 "
                    f"(trainer), which hosts it, probably died")
        return f"{record['rank']} failed first: {record['cause']}"

    def publish_verdict(self, error: str | None) -> None:
        """Rank 0: the verdict of the refit whose status was exchanged last ("" = it landed
        on every engine), for the trainers waiting in `await_verdict`."""
        self._control.set(_VERDICT_KEY.format(self.refits), json.dumps({"error": error or ""}))
        self._published = self.refits

    def await_verdict(self, what: str) -> None:
        """A trainer other than rank 0: wait (bounded, reading the abort record) for rank 0's
        verdict of the refit whose status was exchanged last; raise `RefitAborted` with rank
        0's error if it did not land."""
        key, t0 = _VERDICT_KEY.format(self.refits), time.monotonic()
        try:
            self._poll(lambda: self._control.check([key]), t0 + self.timeout_s, 2e-3)
        except Exception as e:  # noqa: BLE001 - an abort, the deadline, or the store's death
            raise RefitCommError(f"{self.label}: {what}: no verdict from refit rank 0 after "
                                 f"{time.monotonic() - t0:.1f}s: {clean(e) or type(e).__name__}"
                                 f"{self.members()}") from None
        error = json.loads(self._control.get(key))["error"]
        self._control.add(_VERDICT_READ_KEY.format(self.refits), 1)  # rank 0 may now leave
        if error:
            raise RefitAborted(f"{self.label}: {what} did not land (refit rank 0's verdict, "
                               f"after the bytes arrived): {error}")

    def linger_for_verdict(self) -> None:
        """Rank 0, leaving: the store it hosts goes with it, so first let the other trainers
        read the last verdict it published (at most `VERDICT_LINGER_S`; not after an abort)."""
        if self._published is None or self.num_trainers == 1:
            return
        key = _VERDICT_READ_KEY.format(self._published)
        deadline = time.monotonic() + min(self.timeout_s, VERDICT_LINGER_S)
        # an abort, the deadline or a dead store ends it: nobody is left to read it then
        with contextlib.suppress(Exception):
            if self.aborted is None:
                self._poll(lambda: int(self._control.add(key, 0)) >= self.num_trainers - 1,
                           deadline, 1e-3)
        self._published = None

    def members(self) -> str:
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
        """Broadcast a byte string of any length from `src` (two broadcasts: length, data)."""
        length = torch.tensor([len(data) if data is not None else 0], device=self.device)
        self.wait(self.broadcast(length, src), f"{what} (length)")
        size = int(length.item())
        buf = torch.empty(size, dtype=torch.uint8, device=self.device)
        if self.rank == src:
            buf.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
        self.wait(self.broadcast(buf, src), what)
        return bytes(buf.cpu().numpy().tobytes())

    def all_gather_bytes(self, data: bytes, size: int, what: str) -> list[bytes]:
        """Every rank's `data` (truncated / zero-padded to `size` bytes), in rank order: one
        broadcast per rank (a transport with an all-gather overrides this)."""
        out = []
        for src in range(self.world_size):
            buf = padded(data if src == self.rank else b"", size, self.device)
            self.wait(self.broadcast(buf, src), f"{what} (rank {src})")
            out.append(bytes(buf.cpu().numpy().tobytes()).rstrip(b"\0"))
        return out


def padded(data: bytes, size: int, device: torch.device) -> torch.Tensor:
    """`data` truncated / zero-padded to `size` bytes, as a uint8 tensor on `device`."""
    buf = torch.zeros(size, dtype=torch.uint8)
    if raw := data[:size]:
        buf[: len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    return buf.to(device)
