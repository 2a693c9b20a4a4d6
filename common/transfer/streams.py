"""A receiver's whole and compact frames of one refit, from every source stream at once.

Frames are posted in plan order (`common.transfer.schedule`, whose docstring has the order
rule), each once every frame before it is posted and its slot is free again, and handed to the
loader as soon as it has arrived, whichever stream it came from: loaders see arrival order. A
slot: a whole bucket's fixed buffer (`Endpoint.slot_of`), or for the k-th compact frame its
set's compact buffer k modulo their number; so at most `Endpoint.num_slots` frames are in
flight, and at most one oversize tensor (received into a tensor of its own) beyond them. With
one ordered stream the same loop keeps up to `num_buffers` frames in flight and applies them in
plan order.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from common.plan import Bucket
from common.shard.replan import Route
from common.stats import RefitStats
from common.wire.bucket_header import Header


class StreamReceive:
    """One refit's frames of this worker (see the module doc)."""

    def __init__(self, rx, frames: list[tuple[Bucket, Route]], stats: RefitStats) -> None:
        self.rx, self.stats = rx, stats
        self.frames = frames  # in plan order
        self.slots = [rx.slot_of[bucket.index] if route.gather is None else k % rx.num_slots
                      for k, (bucket, route) in enumerate(frames)]

    def run(self, check: Callable, hand_over: Callable) -> BaseException | None:
        """Receive every frame; `check(bucket, route, header, error, first)` -> the refit's
        error after a header, `hand_over(bucket, route, payload, staged)` -> the error after
        loading it. Returns the refit's error."""
        rx, error = self.rx, None
        posted: dict[int, tuple[list, torch.Tensor | None]] = {}
        busy: set[int] = set()  # slots whose frame is posted or not yet handed over
        nxt, first = 0, True
        while nxt < len(self.frames) or posted:
            nxt = self._post_ready(nxt, posted, busy)
            k = self._wait_first(posted)
            _, target = posted.pop(k)
            bucket, route = self.frames[k]
            direct = bucket.direct and route.gather is None
            raw, payload = (rx.headers[self.slots[k]], target) if direct else \
                rx.frame(bucket, route, self.slots[k])
            header = Header.decode(raw)
            error = check(bucket, route, header, error, first)
            first = False
            if error is None and (error := rx.verify_bytes(bucket, header, payload,
                                                           header.checksum, self.stats)) is None:
                error = hand_over(bucket, route, payload, False)
            busy.discard(self.slots[k])
        return error

    def _post_ready(self, nxt: int, posted: dict, busy: set[int]) -> int:
        """Post frames in order from `nxt` while their slots are free; the next to post."""
        while nxt < len(self.frames) and self.slots[nxt] not in busy:
            bucket, route = self.frames[nxt]
            if bucket.oversize and route.gather is None and any(
                    self.frames[k][0].oversize and self.frames[k][1].gather is None
                    for k in posted):
                break
            posted[nxt] = self.rx.post_frame(bucket, route, self.slots[nxt])
            busy.add(self.slots[nxt])
            nxt += 1
        return nxt

    def _wait_first(self, posted: dict[int, tuple[list, torch.Tensor | None]]) -> int:
        """The posted frame that arrived first (the longest posted of those that have); with
        one ordered stream the oldest, so frames are applied in plan order as before."""
        if not self.rx.schedule.concurrent:
            k = min(posted)
            self.rx.wait_all(posted[k][0], self.stats)
            return k
        t0 = time.perf_counter()
        k = self.rx.group.wait_first({k: works for k, (works, _) in posted.items()})
        self.stats.wait_s += time.perf_counter() - t0
        return k
