"""What a receiver checks of each frame before loading anything of it: its header against the
plan (the version, the protocol's step, an ABORT), its bytes against the sender's checksum,
and, when the trainers resend a version to verify, against the base it holds."""

from __future__ import annotations

import time

import torch

from common.delta.frames import DELTA
from common.errors import RefitAborted, RefitError
from common.packing import first_differing
from common.plan import Bucket, RefitPlan
from common.shard.replan import Route
from common.stats import RefitStats
from common.wire import checksum
from common.wire.bucket_header import STATUS_OK, Header
from common.wire.transport import Transport


def header_error(label: str, plan: RefitPlan, bucket: Bucket, route: Route, header: Header,
                 version: int | None, stats: RefitStats, error: BaseException | None,
                 first: bool) -> BaseException | None:
    """The refit's error after this frame's header: the first frame fixes the version (a
    `version` other than it fails the refit), a header out of step raises at once, an ABORT
    fails the refit. A delta frame is smaller than its whole frame; an ABORT in delta mode
    carries no payload."""
    if first:
        stats.version = header.version
        if version is not None and header.version != version:
            error = RefitError(f"{label}: the trainers sent refit v{header.version}, this "
                               f"receiver expected v{version}")
    size, kind = route.payload_bytes(bucket), route.kind
    if header.kind == DELTA and header.payload_bytes < size:
        size, kind = header.payload_bytes, DELTA
    elif header.status != STATUS_OK and header.payload_bytes == 0:
        size = 0
    expected = Header(bucket.index, len(plan.buckets), stats.version, plan.digest,
                      need_set=route.set_index, kind=kind, payload_bytes=size)
    if why := header.mismatch(expected):
        raise RefitError(f"{label}: protocol out of step at bucket {bucket.index}: {why}; "
                         f"destroy and rebuild the refit group")
    if header.status != STATUS_OK:
        error = error or RefitAborted(f"{label}: sender rank {bucket.source_rank} aborted "
                                      f"refit v{header.version}: {header.message}")
    return error


def checksum_error(group: Transport, plan: RefitPlan, bucket: Bucket, header: Header,
                   payload: torch.Tensor, expected: int, stats: RefitStats,
                   what: str) -> RefitError | None:
    """`payload` against the sender's checksum `expected` (if it sent one): an error naming
    the bucket and its tensors if they differ."""
    if not header.checksummed:
        return None
    t0 = time.perf_counter()
    got = checksum.compute(payload)
    stats.checksum_s += time.perf_counter() - t0
    if got == expected:
        return None
    specs = plan.bucket_specs(bucket)
    return RefitError(f"{group.label}: refit v{header.version} bucket {bucket.index}/"
                      f"{len(plan.buckets)} {what} ({header.payload_bytes} bytes of "
                      f"{specs[0].name!r}..{specs[-1].name!r}): "
                      f"{checksum.name(group.device)} {got:#010x}, the sender's "
                      f"{expected:#010x}; it was not loaded")


def first_differing_name(plan: RefitPlan, bucket: Bucket, route: Route, held: torch.Tensor,
                         payload: torch.Tensor) -> str | None:
    """What of a frame differs from `held` (its base): the first tensor of a whole frame
    (not its alignment padding: `first_differing`), "its compact frame", or None."""
    if held.numel() != payload.numel():
        return f"its {held.numel()}-byte base (a {payload.numel()}-byte frame)"
    if route.gather is not None:
        return None if torch.equal(held.to(payload.device), payload) else \
            f"its compact frame (need-set {route.set_index})"
    at = first_differing(plan.bucket_specs(bucket), bucket.offsets, held, payload)
    return None if at is None else repr(plan.specs[bucket.start + at].name)
