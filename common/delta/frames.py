"""Delta refits on the wire: which need-sets go as deltas, and how their frames travel.

At a refit's start (with `RefitConfig.delta`) every rank reports, per need-set, the version of
the frames it holds for that set's layout (a trainer its shadow, a worker its base;
`common.delta.store`), and a set whose members and trainers all hold one version goes in
delta mode on top of it; any other set (a new or restarted worker, a relearned map, a
verification) goes whole, decided before a byte moves. In delta mode each frame is a header
broadcast (fixed size) from the frame's source, then its payload: a delta (`common.delta.codec`,
kind `DELTA`) or, where that would not be smaller, the whole frame; every other rank of the
set posts the payload's receive once the header has landed, so all ranks issue the set's
collectives in one order. A worker posts the next frame's header and payload before it
applies the current one, so loading overlaps the transfer.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from common.delta import codec as delta
from common.delta.store import NO_BASE, NOT_A_MEMBER, FrameStore, agree_on_bases
from common.errors import RefitError
from common.plan import Bucket
from common.shard.replan import Route
from common.wire import checksum
from common.wire.bucket_header import HEADER_BYTES, STATUS_OK, Header

DELTA = 2  # frame kind: a delta on the set's base (`common.shard.plan` has FULL, COMPACT)
WHOLE = "whole"  # the frame layout key of whole buckets


def set_keys(endpoint) -> dict[int, str]:
    """Need-set index -> its frame layout key (-1: the whole group, no need-sets)."""
    shard = endpoint.sharding.shard
    if shard is None:
        return {-1: WHOLE}
    return {s.index: WHOLE if s.full else s.needs.digest for s in shard.sets}


def delta_modes(endpoint, reports: dict[int, int], what: str) -> dict[int, int]:
    """Set index -> the base version its frames go on, for the sets in delta mode."""
    keys = list(set_keys(endpoint))
    agreed = agree_on_bases(endpoint.group, [reports.get(k, NOT_A_MEMBER) for k in keys], what)
    return {k: v for k, v in zip(keys, agreed, strict=True) if v is not None}


class ShadowSender:
    """A trainer's shadows (one store per need-set layout) and its delta-mode frames."""

    def __init__(self, endpoint) -> None:
        self.endpoint = endpoint
        cfg, device = endpoint.plan.config, endpoint.group.device
        self.place = device if cfg.shadow == "device" else torch.device("cpu")
        self.pin = self.place.type == "cpu" and device.type == "cuda"
        self.stores: dict[str, FrameStore] = {}
        rank = endpoint.group.rank
        self.sources = any(b.source_rank == rank for b in endpoint.plan.buckets)

    def modes(self, what: str) -> dict[int, int]:
        keys = set_keys(self.endpoint)
        self.stores = {key: self.stores.get(key) or FrameStore(self.place, None, self.pin)
                       for key in keys.values()}
        for key, store in self.stores.items():
            store.begin(key)
        reports = {i: NOT_A_MEMBER if not self.sources
                   else _held(self.stores[key].version) for i, key in keys.items()}
        return delta_modes(self.endpoint, reports, what)

    def keep(self, bucket: Bucket, route: Route, payload: torch.Tensor) -> None:
        """A whole frame this trainer sent outside delta mode: its shadow's next bytes."""
        self.stores[set_keys(self.endpoint)[route.set_index]].stage_whole(bucket.index, payload)

    def send(self, bucket: Bucket, route: Route, header: Header, payload: torch.Tensor | None,
             base_version: int) -> tuple[list, torch.Tensor | None]:
        """Broadcast one frame from its source: a delta on the shadow where smaller, else the
        whole `payload` (None: the ABORT `header` alone); returns the works and the tensor
        they send (alive until waited)."""
        ep, dev = self.endpoint, self.endpoint.group.device
        store = self.stores[set_keys(ep)[route.set_index]]
        wire, fields = None, {"payload_bytes": 0}
        if payload is not None:
            base = store.base(bucket.index)
            wire = None if base is None else delta.encode(payload, base.to(dev), base_version)
            if wire is not None:
                store.stage_delta(bucket.index, wire)
                fields["kind"] = DELTA
                if ep.checksums:
                    fields["rebuilt_checksum"] = checksum.compute(payload)
            else:
                wire = payload
                store.stage_whole(bucket.index, payload)
            fields["payload_bytes"] = wire.numel()
        head = header_with(header, **fields).encode().to(dev)
        if wire is not None and ep.checksums:
            checksum.stamp(head, wire)
        what = f"bucket {bucket.index} frame to need-set {route.set_index}"
        works = [(_post(ep, bucket, route, head), what + " header")]
        if wire is not None and wire.numel():
            works.append((_post(ep, bucket, route, wire), what))
        return works, wire

    def pass_on(self, bucket: Bucket, route: Route,
                what: str) -> tuple[list, torch.Tensor | None]:
        """A frame another trainer sources: take part (its header first, for the size)."""
        ep = self.endpoint
        head = torch.empty(HEADER_BYTES, dtype=torch.uint8, device=ep.group.device)
        ep.group.wait(ep.group.broadcast(head, bucket.source_rank, route.sub), what + " header")
        size = Header.decode(head).payload_bytes
        if not size:
            return [], None
        data = torch.empty(size, dtype=torch.uint8, device=ep.group.device)
        return [(_post(ep, bucket, route, data), what)], data

    def commit(self, version: int) -> None:
        for store in self.stores.values():
            store.commit(version)

    def abort(self) -> None:
        for store in self.stores.values():
            store.abort()


def header_with(header: Header, **fields: object) -> Header:
    return Header(**{**header.__dict__, **fields})


def _held(version: int | None) -> int:
    return NO_BASE if version is None else version


def _post(ep, bucket: Bucket, route: Route, data: torch.Tensor):
    return ep.group.broadcast(data, bucket.source_rank, route.sub)


class DeltaReceive:
    """One refit's frames of this worker's need-set in delta mode (see the module doc)."""

    def __init__(self, rx, frames: list[tuple[Bucket, Route]], base_version: int,
                 stats) -> None:
        self.rx, self.frames, self.base_version, self.stats = rx, frames, base_version, stats
        dev, n = rx.group.device, rx.num_buffers
        self.heads = [torch.empty(HEADER_BYTES, dtype=torch.uint8, device=dev)
                      for _ in range(2)]
        self.scratch = rx.delta_buffers()
        self.posted: dict[int, tuple[list, Header | None, torch.Tensor | None]] = {}
        self.ahead = n >= 2

    def run(self, hand_over: Callable, check: Callable) -> BaseException | None:
        """Receive every frame; `check(bucket, route, header, error, first)` -> the refit's
        error after a header (it raises when the protocol is out of step),
        `hand_over(bucket, route, payload, staged)` -> the error after loading it. Returns
        the refit's error."""
        self.check, self.error = check, None
        if not self.frames:
            return None
        self._post_header(0)
        self._post_payload(0)
        for k in range(len(self.frames)):
            works, header, land = self.posted.pop(k)
            self.rx.wait_all(works, self.stats)
            if self.ahead and k + 1 < len(self.frames):
                self._post_payload(k + 1)
            if self.error is None and header.status == STATUS_OK:
                self.error = self._take(k, header, land, hand_over)
            if not self.ahead and k + 1 < len(self.frames):
                self._post_payload(k + 1)
        return self.error

    def _post_header(self, k: int) -> None:
        bucket, route = self.frames[k]
        head = self.heads[k % 2]
        self.posted[k] = ([(_post(self.rx, bucket, route, head),
                            f"refit bucket {bucket.index} header")], None, None)

    def _post_payload(self, k: int) -> None:
        """Wait for frame k's header, post its payload's receive, then frame k+1's header."""
        works, _, _ = self.posted[k]
        self.rx.wait_all(works, self.stats)
        bucket, route = self.frames[k]
        header = Header.decode(self.heads[k % 2])
        self.error = self.check(bucket, route, header, self.error, k == 0)
        size = header.payload_bytes
        if header.kind == DELTA:
            scratch = self.scratch[k % 2]
            land = scratch[:size] if size <= scratch.numel() else \
                torch.empty(size, dtype=torch.uint8, device=scratch.device)
        else:
            land = self.rx.frame_payload(bucket, route, k)
        works = [(_post(self.rx, bucket, route, land), f"refit bucket {bucket.index}")] \
            if size else []
        self.posted[k] = (works, header, land)
        if k + 1 < len(self.frames):
            self._post_header(k + 1)

    def _take(self, k: int, header: Header, land: torch.Tensor,
              hand_over: Callable) -> BaseException | None:
        """Check frame k's bytes, rebuild a delta into the frame's payload, hand it over."""
        rx, (bucket, route) = self.rx, self.frames[k]
        if error := rx.verify_bytes(bucket, header, land, header.checksum, self.stats):
            return error
        payload = land
        if header.kind == DELTA:
            t0 = time.perf_counter()
            payload = rx.frame_payload(bucket, route, k)
            base = rx.base.base(bucket.index)
            try:
                if base is None:
                    raise delta.DeltaError("this worker holds no base for it")
                payload.copy_(base)
                delta.apply(land, payload, self.base_version)
            except delta.DeltaError as e:
                return RefitError(f"{rx.group.label}: refit v{header.version} bucket "
                                  f"{bucket.index} ({rx.first_name(bucket)!r}..): its delta "
                                  f"was refused, nothing of it loaded: {e}")
            self.stats.delta_s += time.perf_counter() - t0
            if error := rx.verify_bytes(bucket, header, payload, header.rebuilt_checksum,
                                        self.stats, "rebuilt from its delta"):
                return error
            rx.base.stage_delta(bucket.index, land)
            self.stats.delta_frames += 1
        return hand_over(bucket, route, payload, header.kind == DELTA)
